"""What every rank of one in-job ``benchmarks.scale`` job runs: gather, save, same-W load, other-W load.

The model is ``benchmarks.models``' residual stack of width ``d`` with ``units - 1`` blocks, each block its
own fsdp_optim (fairscale) FSDP unit plus the root: ``units`` units, tiny state, so the time is the
bookkeeping that grows with units and ranks, not the bytes. One Adam step gives every unit state.

Each operation is timed between two barriers (so it is the slowest rank's time) ``repeats`` times after one
warm-up; the median is kept. The other-W load reads the checkpoint a job of ``2W`` ranks saved (a re-cut:
each rank of this job reads the parts of about two of its rank files).
"""

from __future__ import annotations

import resource
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_optim import gather_full_optim_state_dict, load_sharded_optim_state, save_sharded_optim_state

from .. import models
from ..ckpt.common import difference
from ..peak import rounds


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median of ``repeats`` calls after one, each between two barriers (the slowest rank's time)."""
    return statistics.median(rounds({"call": fn}, warmup=1, repeats=repeats, sync=dist.barrier)["call"])


def run(rank: int, world_size: int, units: int, width: int, own: str, other: str | None, repeats: int) -> dict[str, Any]:
    """One job's measurements (rank 0's dict is the job's; every rank checks its loads are exact)."""
    spec = models.ModelSpec(f"{width}x{units - 1}", width, units - 1)
    device = torch.device("cpu")
    model = models.wrap_fairscale(spec, device)
    optim = models.train(model, spec, 1, rank, device)
    fresh = torch.optim.Adam(model.parameters(), lr=models.LR)
    out: dict[str, Any] = {"world_size": world_size, "units": units}
    out["gather_s"] = _timed(lambda: gather_full_optim_state_dict(model, optim), repeats)
    out["save_s"] = _timed(lambda: save_sharded_optim_state(model, optim, own, overwrite=True), repeats)
    out["load_same_s"] = _timed(lambda: load_sharded_optim_state(model, fresh, own), repeats)
    same = difference(fresh.state_dict()["state"], optim.state_dict()["state"], "state")
    assert not same, f"rank {rank}: same-W load differs from the saved state: {same}"
    full = gather_full_optim_state_dict(model, optim)
    if rank == 0:  # what a job of W/2 ranks must find after loading this job's checkpoint
        torch.save(full, f"{own}.full.pt")
    if other is not None:
        out["load_other_s"] = _timed(lambda: load_sharded_optim_state(model, fresh, other), repeats)
        found = gather_full_optim_state_dict(model, fresh)
        if rank == 0:
            text = difference(found and found["state"], torch.load(f"{other}.full.pt", weights_only=True)["state"], "state")
            assert not text, f"other-W load differs from the saving job's state: {text}"
    out["state_bytes"] = sum(
        v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    peaks = [None] * world_size
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out["peak_rss_max"] = max(peaks)  # type: ignore[type-var]
    return out
