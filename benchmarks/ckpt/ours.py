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

The whole state (weights, buffers, optimizer state), ``whole_*``: ``save_checkpoint`` (``whole_save``),
``async_save_checkpoint`` (``whole_async``; recorded: until its handle's ``wait()`` returns, committed),
``load_checkpoint`` into zeroed weights and a fresh Adam from this job's checkpoint (``whole_load_same``) and from
another world size's into the model at another FSDP nesting (``whole_load_other``). A same-W load must give back
the live weight shards and optimizer state bit for bit (which also checks ``whole_save``); an other-W load the
saving job's full weights and, cut for this rank, its gathered optimizer state (``whole_reference``).
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
from .common import Loads, Probes, difference, fresh_load_methods, load_method, measured_and_removed, reloads, wrong


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


def whole_reference(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A collective: the full weights (every rank) and the full optimizer state (rank 0) the checks compare with."""
    return {"model": model.state_dict(), "optim": model.gather_full_optim_state_dict(optim)}  # type: ignore[operator]


def whole_save_methods(model: nn.Module, optim: torch.optim.Optimizer, *, directory: Path, async_dir: Path, probes: Probes) -> dict[str, Method]:
    methods = {"whole_save": Method(lambda: fsdp_optim.save_checkpoint(model, optim, directory))}
    methods["whole_async"] = probes.wrap(
        "whole_async", Method(lambda: fsdp_optim.async_save_checkpoint(model, optim, async_dir)), durable=lambda handle: handle.wait()
    )
    return methods


def whole_load_same(model: nn.Module, optim: torch.optim.Optimizer, *, directory: Path, probes: Probes) -> dict[str, Method]:
    load = lambda target: fsdp_optim.load_checkpoint(model, target, directory)  # noqa: E731
    return {"whole_load_same": reloads("whole_load_same", model, optim, load, probes)}


def whole_load_other(model: nn.Module, *, directory: Path, reference_file: Path, probes: Probes) -> dict[str, Method]:
    """Into ``model`` (another nesting, this job's world size) from a checkpoint saved at another world size."""

    def check(loaded: torch.optim.Optimizer) -> str:
        weights = model.state_dict()  # a collective, first: every rank reaches it
        ref = torch.load(reference_file, mmap=True, weights_only=False)
        expected = model.get_shard_from_optim_state_dict(ref["optim"], optim=loaded)  # type: ignore[operator]
        return wrong(difference(weights, ref["model"], "weights") or difference(loaded.state_dict(), expected, "optim"))

    load = lambda target: fsdp_optim.load_checkpoint(model, target, directory)  # noqa: E731
    return {"whole_load_other": load_method("whole_load_other", model, load, check, probes)}
