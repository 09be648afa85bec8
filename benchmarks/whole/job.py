"""What every rank runs for one world size of the whole-state benchmark.

1. Build the model twice, as fsdp_optim's (fairscale) FSDP with a unit per block and as FSDP2, and train each
   the same Adam steps; build it a third time at another nesting (a unit per Linear) for the other-W load.
2. Saves, interleaved: the per-rank floor, ``save_checkpoint``, ``async_save_checkpoint``, DCP save and DCP
   async_save of ``get_state_dict``. This job's checkpoint stays on disk for step 4 and, when ``publish_ref``, for a
   later job of another world size, with a reference beside it.
3. fairscale's full ``state_dict()`` save (few calls, for its peak RSS).
4. Loads, interleaved: the floor, ``load_checkpoint`` from this job's checkpoint, DCP load + ``set_state_dict``,
   and ``load_checkpoint`` from another world size's checkpoint into the other nesting.
5. fairscale's full ``load_state_dict()`` load (few calls, for its peak RSS).

A ``source_only`` job trains and writes its checkpoint and reference only, for the jobs that load it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp_optim

from .. import models
from ..ckpt import floors
from ..ckpt.common import Job, Probes, disk_bytes, publish, remove
from ..measure import Method, NotAvailable
from . import dcp as whole_dcp
from . import fullsd, ours


@dataclass(frozen=True)
class Source:
    """Where a job of ``world_size`` ranks keeps its whole checkpoint and the reference it must load to."""

    world_size: int
    checkpoint: str
    reference: str


@dataclass(frozen=True)
class JobConfig(Job):
    peer_repeats: int  # calls of fairscale's full state dict save and load (no warm-up)
    work: str  # this job's scratch directory (removed by the caller)
    own: Source
    publish_ref: bool  # a later job loads ``own``: write the reference
    other: Source | None  # a checkpoint saved at another world size, to load here
    source_only: bool = False



def run(rank: int, world_size: int, cfg: JobConfig) -> dict[str, Any] | None:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    model, optim = cfg.build(models.wrap_fairscale, rank)
    if cfg.source_only:
        fsdp_optim.save_checkpoint(model, optim, cfg.own.checkpoint)
        publish({cfg.own.reference: ours.reference(model, optim)} if cfg.publish_ref else {})
        return None
    fsdp2 = cfg.build(models.wrap_fsdp2, rank)
    nested = models.wrap_fairscale_linears(cfg.model, torch.device("cpu")) if cfg.other else None
    group = dist.new_group(backend="gloo")  # DCP async's own group: its thread's collectives stay apart
    timings["build_train_s"] = time.perf_counter() - start
    own_bytes = {"own": floors.own_bytes(model, optim), "nested": floors.own_bytes(nested, None) if nested else 0}

    work = Path(cfg.work)
    dirs = {name: work / name for name in ("floor", "dcp", "dcp-async", "whole-async")}
    dirs["floor"].mkdir(parents=True, exist_ok=True)
    checkpoint, full_file = Path(cfg.own.checkpoint), work / "fullsd.pt"
    fast = {"warmup": cfg.warmup, "repeats": cfg.repeats}
    slow = {"warmup": 0, "repeats": cfg.peer_repeats}
    results: dict[str, Any] = {}

    phase = time.perf_counter()
    probes = Probes()
    saves = {"floor_save": Method(lambda: floors.save(floors.own_state(model, optim), dirs["floor"], rank))}
    saves |= ours.save_methods(model, optim, directory=checkpoint, async_dir=dirs["whole-async"], probes=probes)
    saves |= whole_dcp.save_methods(*fsdp2, where=whole_dcp.location(dirs["dcp"]), async_dir=dirs["dcp-async"], group=group, probes=probes)
    results |= cfg.measure(saves, probes, **fast)
    results |= cfg.measure(fullsd.save_methods(model, optim, path=full_file), Probes(), **slow)
    publish({cfg.own.reference: ours.reference(model, optim)} if cfg.publish_ref else {})
    timings["saves_s"] = time.perf_counter() - phase
    disk = _disk({"floor_save": dirs["floor"], "whole_save": checkpoint, "dcp_save": dirs["dcp"], "fullsd_save": full_file})
    for name in ("dcp-async", "whole-async"):
        if rank == 0:
            remove(dirs[name])

    phase = time.perf_counter()
    probes = Probes()
    loads = {"floor_load": Method(lambda: floors.load(floors.rank_file(dirs["floor"], rank)))}
    loads |= ours.load_same(model, optim, directory=checkpoint, probes=probes)
    loads |= whole_dcp.load_same(*fsdp2, where=whole_dcp.location(dirs["dcp"]), probes=probes)
    if cfg.other is not None and nested is not None:
        loads |= ours.load_other(nested, directory=Path(cfg.other.checkpoint), reference_file=Path(cfg.other.reference), probes=probes)
    else:
        results["whole_load_other"] = NotAvailable("not measured: needs two world sizes (--world-sizes)")
    results |= cfg.measure(loads, probes, **fast)
    probes = Probes()
    results |= cfg.measure(fullsd.load_methods(model, path=full_file, probes=probes), probes, **slow)
    timings["loads_s"] = time.perf_counter() - phase

    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, own_bytes)
    dist.barrier()
    if rank != 0:
        return None
    return {
        "results": results,
        "disk": disk,
        "timings": timings,
        "own_bytes": {key: [e[key] for e in everyone] for key in ("own", "nested")},
        "other_world_size": cfg.other.world_size if cfg.other else None,
    }


def _disk(paths: dict[str, Path]) -> dict[str, int]:
    dist.barrier()
    return {name: disk_bytes(path) for name, path in paths.items() if path.exists()} if dist.get_rank() == 0 else {}


__all__ = ["JobConfig", "Source", "run"]
