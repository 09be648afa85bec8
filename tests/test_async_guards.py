"""An async save is the state at the call: every change of what it is still copying waits for the copy first, not
only its own optimizer's ``step()`` / ``load_state_dict()``. Keyed by the root too: ``load_checkpoint(model, None,
...)``, ``model.load_state_dict(...)`` and a second optimizer over the same root.

Real gloo ranks, real fairscale FSDP, real async saves and files. The save's copy into host memory is held back until
the change has returned (or a few seconds, when the change rightly waits for it): a change that does not wait lands
in the checkpoint, and the checkpoint then differs from the state at the call.
"""

from __future__ import annotations

import threading
from typing import Any

import _models as M
import pytest
import torch
from _dist import run_ranks

import fsdp_optim

HOLD_S = 5.0  # how long a copy is held back when nothing lets it go: the change waited for it, as it must
CHANGES = ("load_checkpoint without optim", "model.load_state_dict", "a second optimizer's step")


def _hold_copies() -> threading.Event:
    """The async save's copy waits for the returned event (at most HOLD_S): what a change does first lands first."""
    from fsdp_optim.job import staging

    gate = threading.Event()
    copy = staging.HostStaging.copy

    def held(self: staging.HostStaging, *args: Any, **kwargs: Any) -> Any:
        gate.wait(HOLD_S)
        return copy(self, *args, **kwargs)

    staging.HostStaging.copy = held  # type: ignore[method-assign]  # this rank's process only
    return gate


def _change_during_save(rank: int, world_size: int, out: str, change: str) -> dict[str, Any]:
    model = M.wrap(M.make_net(0), "deep")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    other = M.wrap(M.make_net(7), "deep")  # what the change puts in: another model's weights
    fsdp_optim.save_checkpoint(other, None, f"{out}/other")
    other_weights = other.state_dict()
    for step in range(2):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    second = torch.optim.SGD(model.parameters(), lr=1.0)  # over the same root: its step changes the saved weights
    optim.zero_grad()
    model(M.local_batch(2, rank, world_size)[0]).float().sum().backward()  # gradients for it (not saved)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    gate = _hold_copies()
    handle = fsdp_optim.async_save_checkpoint(model, optim, f"{out}/async")
    if change == "load_checkpoint without optim":
        fsdp_optim.load_checkpoint(model, None, f"{out}/other")
    elif change == "model.load_state_dict":
        model.load_state_dict(other_weights)
    else:
        second.step()
    gate.set()
    handle.wait()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, at_call[k])]
    fresh = M.wrap(M.make_net(3), "deep")
    fsdp_optim.load_checkpoint(fresh, None, f"{out}/async")
    saved = fresh.state_dict()
    return {"changed": bool(changed), "differ": sorted(k for k, v in at_call.items() if not torch.equal(saved[k], v))}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_during_an_async_save_waits_for_its_copy(change: str, tmp_path) -> None:
    for rank, found in enumerate(run_ranks(_change_during_save, 2, str(tmp_path), change)):
        assert found["changed"], f"rank {rank}: {change} changed nothing, so it proves nothing"
        assert not found["differ"], f"rank {rank}: the checkpoint is not the state at the call after {change}: {found}"
