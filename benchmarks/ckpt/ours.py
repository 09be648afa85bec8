"""Our checkpoint paths as ``Method``s, through ``fsdp_optim``'s public API only.

- ``ours_save``: ``save_sharded_optim_state(fsdp, optim, dir)``;
- ``ours_async``: ``async_save_sharded_optim_state(fsdp, optim, dir)`` (timed:
  the blocking call; recorded: the time until ``handle.wait()`` returns, the checkpoint durable);
- ``ours_load_same`` / ``ours_load_other``: ``load_sharded_optim_state`` into a fresh Adam from the
  checkpoint this job saved, and from one saved by a job of another world size;
- ``ours_consolidate``: offline ``consolidate(dir)`` then ``torch.save`` + fsync of the full dict (rank 0);
- ``ours_reshard``: offline ``reshard(dir, M, out)`` (rank 0).

Checks: a save (or reshard) is consolidated and compared with the full dict that
``gather_full_optim_state_dict`` returned before timing, bit for bit; a load is compared, on every
rank, with the live optimizer's ``state_dict()`` (same world size) or with this rank's shard of the
other job's gathered dict (``get_shard_from_optim_state_dict``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_optim

from ..measure import Method
from ..peak import save_durably
from .common import Loads, Probes, difference, fresh_load_methods, measured_and_removed, wrong


def _saved_matches(directory: Path, reference: dict[str, Any] | None, *, any_world_size: bool = False) -> str:
    """Rank 0: the checkpoint in ``directory`` consolidates to ``reference`` exactly ("" elsewhere)."""
    if dist.get_rank() != 0:
        return ""
    full = fsdp_optim.consolidate(directory)
    if any_world_size:  # a resharded copy records the world size it was cut for; all else must match
        full = {**full, "fsdp_optim": {**full["fsdp_optim"], "world_size": reference["fsdp_optim"]["world_size"]}}  # type: ignore[index]
    return wrong(difference(full, reference, "full"))


def save_methods(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    same_dir: Path,
    async_dir: Path,
    reference: dict[str, Any] | None,
    probes: Probes,
) -> dict[str, Method]:
    methods = {
        "ours_save": probes.wrap(
            "ours_save",
            Method(lambda: fsdp_optim.save_sharded_optim_state(model, optim, same_dir)),
            lambda _: _saved_matches(same_dir, reference),
        )
    }
    methods["ours_async"] = probes.wrap(
        "ours_async",
        Method(lambda: fsdp_optim.async_save_sharded_optim_state(model, optim, async_dir)),
        lambda _: _saved_matches(async_dir, reference),
        durable=lambda handle: handle.wait(),
    )
    return methods


def load_methods(model: nn.Module, optim: torch.optim.Optimizer, where: Loads) -> dict[str, Method]:
    """Loads into a fresh optimizer, built (untimed) before each call."""

    def other_wrong(loaded: torch.optim.Optimizer, full: Any) -> str:
        expected = model.get_shard_from_optim_state_dict(full, optim=loaded)  # type: ignore[operator]
        return wrong(difference(loaded.state_dict(), expected, "state_dict"))

    return fresh_load_methods("ours", model, optim, lambda target, directory: fsdp_optim.load_sharded_optim_state(model, target, directory), other_wrong, where)


def offline_methods(
    *,
    same_dir: Path,
    out_dir: Path,
    reshard_to: int | None,
    reference: dict[str, Any] | None,
    disk: dict[str, int],
) -> dict[str, Method]:
    """Offline tools, run by rank 0 while the other ranks wait at the next barrier."""
    rank = dist.get_rank()
    full_file = out_dir / "ours-full.pt"
    resharded = out_dir / "ours-resharded"

    def consolidate() -> dict[str, Any] | None:
        if rank != 0:
            return None
        full = fsdp_optim.consolidate(same_dir)
        save_durably(full, full_file)
        return full

    def reshard() -> Path | None:
        return fsdp_optim.reshard(same_dir, reshard_to, resharded) if rank == 0 else None  # type: ignore[arg-type]

    methods = {
        "ours_consolidate": Method(
            consolidate,
            check=lambda full: wrong(difference(full, reference, "full")),
            finish=measured_and_removed(disk, "ours_consolidate", full_file),
        )
    }
    if reshard_to is not None:
        methods["ours_reshard"] = Method(
            reshard,
            check=lambda _: _saved_matches(resharded, reference, any_world_size=True),
            finish=measured_and_removed(disk, "ours_reshard", resharded),
        )
    return methods
