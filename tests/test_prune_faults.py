"""A manager's prune killed at seeded moments (SIGKILL, one or two SIGINTs), at world sizes 1 and 2, on real files.

A job saves steps 1..3 (every step, keep 1); during the prune after step 3 (which removes step 2), rank 0 sends
itself a real signal at a seeded moment: the n-th Python or C call of its removal. Then:

- ``fsdp-optim list`` shows no step torn: step 2 is complete, being pruned, or gone;
- a new job restores step 3 bit-exact, saves step 4 and prunes;
- nothing of the killed prune is left: no lock file, no prune mark, no step directory but 3 and 4.

The full campaign (54 moments: W = 1, 2; SIGKILL, SIGINT, two SIGINTs; 9 seeds each) is slow (FSDP_OPTIM_SLOW=1);
the default run takes a bounded sample of 6.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.cli import main

KILL, INT, INT_TWICE = "SIGKILL", "SIGINT", "SIGINT twice"
CALLS_IN_A_REMOVAL = 600  # about what the removal of one step directory calls (moments are drawn below it)


def _signal_during_prune(how: str, moment: int) -> None:
    """From now on, the ``moment``-th call made once the prune's ``remove_step`` began sends this process ``how``."""
    seen = [0, False]

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "remove_step":
            seen[1] = True
        if not seen[1] or event not in ("call", "c_call"):
            return
        seen[0] += 1
        if seen[0] == moment:
            os.kill(os.getpid(), signal.SIGKILL if how == KILL else signal.SIGINT)
            if how == INT_TWICE:
                os.kill(os.getpid(), signal.SIGINT)

    sys.setprofile(profile)


def _job(rank: int, world_size: int, root: str, steps: range, fault: tuple[str, int] | None) -> dict[str, Any]:
    manager = fsdp_optim.CheckpointManager(root, every=1, keep=1)
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    extra = manager.restore(model, optim)
    restored = model.gather_full_optim_state_dict(optim) if extra is not None else None
    for step in steps:
        M.train_step(model, optim, *M.local_batch(step - 1, rank, world_size))
        if step == steps[-1]:
            full = model.gather_full_optim_state_dict(optim)
            if rank == 0:
                torch.save(full, Path(root).parent / f"expected-{step}.pt")
            if fault is not None and rank == 0:
                _signal_during_prune(*fault)
        manager.save(step, model, optim, extra={"step": step})
    sys.setprofile(None)
    return {"extra": extra, "restored": restored}


def _states(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[int, str]:
    assert main(["list", str(root)]) == 0, "fsdp-optim list exits 0 whatever it finds"
    lines = capsys.readouterr().out.splitlines()
    return {int(line.split()[1]): line.split(None, 2)[2].split(":")[0].split("  ")[0] for line in lines}


def _cases() -> list[Any]:
    full = [(w, how, seed) for w in (1, 2) for how in (KILL, INT, INT_TWICE) for seed in range(9)]
    sample = {(1, KILL, 0), (1, INT_TWICE, 1), (2, KILL, 2), (2, INT, 3), (1, KILL, 4), (2, INT_TWICE, 5)}
    return [pytest.param(*c) if c in sample else pytest.param(*c, marks=pytest.mark.slow) for c in full]


@pytest.mark.parametrize(("world_size", "how", "seed"), _cases())
def test_prune_killed_at_a_seeded_moment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world_size: int, how: str, seed: int
) -> None:
    root = tmp_path / "ckpt"
    moment = random.Random(f"{world_size}-{how}-{seed}").randrange(1, CALLS_IN_A_REMOVAL)
    try:
        run_ranks(_job, world_size, str(root), range(1, 4), (how, moment))
    except AssertionError as exc:  # the signalled rank exited without a result, or with KeyboardInterrupt
        assert "rank 0" in str(exc), f"only rank 0 prunes, so only it may fail: {exc}"

    states = _states(root, capsys)
    assert 3 in states and states[3] == "complete", states
    assert set(states.values()) <= {"complete", "being pruned"}, f"moment {moment}: a step shown torn: {states}"
    if 2 in states and states[2] == "being pruned":
        assert (root / ".step-00000002.pruning").exists(), sorted(os.listdir(root))

    (result, *_) = run_ranks(_job, world_size, str(root), range(4, 5), None)
    assert result["extra"] == {"step": 3}, f"restored {result['extra']}, expected step 3"
    expected = torch.load(tmp_path / "expected-3.pt", weights_only=False)
    for index, state in expected["state"].items():
        for key, value in state.items():
            got = result["restored"]["state"][index][key]
            assert torch.equal(got, value), f"moment {moment}: param {index} {key} not restored bit-exact"

    left = sorted(os.listdir(root))
    assert left == ["step-00000004"], f"moment {moment} ({how}): left behind {left}"
    assert set(_states(root, capsys).values()) == {"complete"}
