"""A rank that dies during a gather makes the surviving ranks raise instead of hanging.

Each scenario trains the test model on real gloo ranks, then every rank calls
``gather_full_optim_state_dict`` while one of them, the victim, leaves the process with ``os._exit``
the moment it enters its n-th call of a given torch.distributed function: mid-gather, with its peers
inside real collectives or point-to-point transfers. Nothing is mocked: the death is injected with a
``sys.setprofile`` hook that watches for that function's code object.

Every survivor must come out of the gather with an exception (gloo reports the closed connection, or
the shortened collective timeout fires; ``run_ranks``'s deadline kills any rank that would hang, which
fails the test) and its optimizer state must be as it was. Survivors write their outcome to a file,
since ``run_ranks`` reports the victim's missing result as an error and returns nothing else, and then
wait for each other (through those files, not a collective) so that one survivor's exit cannot decide
how another's gather ends.

The victim exits with code 0 on purpose: torch's spawn helper SIGTERMs every other rank as soon as one
exits non-zero, which would end the survivors before they could show what they do. Their peers see the
same closed sockets whatever the exit code.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import _models as M
import pytest
import torch.distributed as dist
from _checks import assert_identical, snapshot
from _dist import run_ranks

TIMEOUT_S = 30  # collective timeout for these runs: the slowest a survivor may be to raise
DEADLINE_S = 150  # a rank still running by then is killed, and the test fails


@dataclass(frozen=True)
class Death:
    world_size: int
    victim: int
    dies_at: Literal["isend", "irecv", "all_gather_object", "broadcast_object_list"]
    nth: int  # the victim dies on entering its nth call of ``dies_at``
    transport: Literal["tensor", "object"] = "tensor"
    recipient: int = 0


SCENARIOS = {
    "a rank dies before the metadata exchange": Death(world_size=2, victim=1, dies_at="all_gather_single", nth=1),
    # The deep-nested test model has 4 flat parameters with Adam state: 8 tensors to move per sender.
    "a sender dies mid-transfer": Death(world_size=2, victim=1, dies_at="isend", nth=3),
    "the recipient dies mid-receive": Death(world_size=2, victim=0, dies_at="irecv", nth=3),
    # Rank 1's pieces all reach the recipient; only rank 2's are lost.
    "another sender dies before sending": Death(world_size=3, victim=2, dies_at="isend", nth=1),
}

# Bugs these scenarios found, strict xfail until fixed.
KNOWN_BUGS: dict[str, str] = {}


def _die_on_entering(function: Any, nth: int) -> None:
    target = inspect.unwrap(function).__code__
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:  # noqa: ARG001
        nonlocal calls
        if event == "call" and frame.f_code is target:
            calls += 1
            if calls == nth:
                os._exit(0)

    sys.setprofile(profile)


def _gather_while_one_dies(rank: int, world_size: int, death: Death, out_dir: str) -> None:
    model = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    M.train_step(model, optim, *M.local_batch(0, rank, world_size))
    before = snapshot(optim.state_dict())
    if rank == death.victim:
        _die_on_entering(getattr(dist, death.dies_at), death.nth)
    start = time.monotonic()
    try:
        model.gather_full_optim_state_dict(optim, recipient_rank=death.recipient, transport=death.transport)
        outcome: dict[str, Any] = {"raised": None, "message": ""}
    except Exception as e:  # noqa: BLE001 - whatever it is, it must be raised
        outcome = {"raised": type(e).__name__, "message": str(e)[:500]}
    outcome["seconds"] = round(time.monotonic() - start, 2)  # reported, not asserted
    try:
        assert_identical(snapshot(optim.state_dict()), before, "optimizer state")
        outcome["optim_changed"] = None
    except AssertionError as e:
        outcome["optim_changed"] = str(e)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    _wait_for_survivors(out_dir, [r for r in range(world_size) if r != death.victim])


def _wait_for_survivors(out_dir: str, survivors: list[int]) -> None:
    """Stay alive until every survivor is out of its gather, so no survivor's exit decides another's fate."""
    stop_at = time.monotonic() + TIMEOUT_S
    while time.monotonic() < stop_at and not all(Path(out_dir, f"rank{r}.json").exists() for r in survivors):
        time.sleep(0.05)


def _scenarios() -> list[Any]:
    xfail = {s: pytest.mark.xfail(strict=True, reason=reason) for s, reason in KNOWN_BUGS.items()}
    return [pytest.param(s, marks=xfail[s]) if s in xfail else s for s in SCENARIOS]


@pytest.mark.parametrize("scenario", _scenarios())
def test_survivors_raise_when_a_rank_dies_mid_gather(scenario: str, tmp_path: Path) -> None:
    death = SCENARIOS[scenario]
    try:
        run_ranks(
            _gather_while_one_dies, death.world_size, death, str(tmp_path), timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S
        )
        reported = "nothing: every rank returned"
    except AssertionError as e:
        reported = str(e)
    # The only rank without a result is the victim, which did die (exit code 0 is our os._exit).
    assert re.fullmatch(rf"rank {death.victim}: exited without a result \(exit code 0\)", reported), (
        f"rank {death.victim} should have died on entering call {death.nth} of dist.{death.dies_at}, and no other "
        f"rank should have failed; run_ranks reported {reported}"
    )
    for rank in range(death.world_size):
        if rank == death.victim:
            continue
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["raised"] is not None, f"survivor rank {rank} returned from the gather: {outcome}"
        assert outcome["optim_changed"] is None, f"survivor rank {rank}: {outcome}"
