"""What every rank runs for one world size of a whole-state benchmark (weights + buffers + optimizer state), on a
local directory (``python -m benchmarks.whole_state``) or on an S3 store (``python -m benchmarks.storage``).

1. Build the model as fsdp_optim's (fairscale) FSDP with a unit per block and as FSDP2, and train each the same Adam
   steps; build it a third time at another nesting (a unit per Linear) for the other-W load.
2. Saves, interleaved: the floor (locally each rank's ``torch.save`` + fsync of its own state; on the store one
   ``floors.upload`` of its state bytes), ``save_checkpoint``, ``async_save_checkpoint`` (timed: the blocking call;
   recorded: until ``wait()`` returns), DCP save of ``get_state_dict`` (locally also ``dcp.async_save`` on a gloo
   group of its own; on the store through ``FsspecWriter`` with the same URL scheme and storage options). On the store
   rank 0 has the server compact what the call before replaced (untimed) before each call, and each rank records how
   long ``ObjectStore.upload`` took inside each ``save_checkpoint``. Locally, fairscale's full ``state_dict()`` save
   follows (few calls, for its peak RSS). This job's checkpoint stays for step 3 and, when ``publish_ref``, for a
   later job of another world size, with a reference beside it.
3. Loads, interleaved: the floor, ``load_checkpoint`` at this world size, DCP ``dcp.load`` + ``set_state_dict``, and
   ``load_checkpoint`` of another world size's checkpoint into the other nesting (checked against the saving job's
   reference). Locally, fairscale's full ``load_state_dict()`` follows (few calls); on the store one more other-W
   load, untimed, through the counting proxy (``Store.counted``): the parent reads how many bytes the server sent.

A ``source_only`` job trains, saves its checkpoint and writes the reference only, for the jobs that load it.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp_optim
from fsdp_optim.disk.storage import ObjectStore

from .. import models
from ..ckpt import floors
from ..ckpt.common import Job, Probes, disk_bytes, publish, remove
from ..measure import Method, NotAvailable
from . import dcp as whole_dcp
from . import fullsd, ours


@dataclass(frozen=True)
class Store:
    """The object-store side of a job: its run's prefix straight to the server and through the counting proxy."""

    root: ObjectStore
    counted: ObjectStore
    storage_options: dict[str, Any]  # for s3fs, DCP's FsspecWriter / FsspecReader
    vacuum_url: str  # the master's compaction endpoint

    def checkpoint(self, world_size: int, counted: bool = False) -> ObjectStore:
        return (self.counted if counted else self.root).child(f"whole-W{world_size}")


def scratch(world_size: int) -> dict[str, str]:
    """The prefixes of a store job's other saves, under names of its own (a removed prefix may leave a marker behind)."""
    return {name: f"{name}-W{world_size}" for name in ("floor", "dcp", "whole-async")}


@dataclass(frozen=True)
class JobConfig(Job):
    work: str  # this job's local scratch directory (removed by the caller); its parent holds the local checkpoints
    refs: str  # the local directory of the references
    publish_ref: bool  # a later job loads this job's checkpoint: write the reference
    other: int | None  # load the checkpoint saved at this world size
    store: Store | None = None  # None: checkpoints in ``work``'s parent directory
    peer_repeats: int = 0  # calls of fairscale's full state dict save and load (local only; no warm-up)
    source_only: bool = False

    def checkpoint(self, world_size: int) -> Any:
        return self.store.checkpoint(world_size) if self.store else Path(self.work).parent / f"whole-W{world_size}"

    def reference(self, world_size: int) -> Path:
        return Path(self.refs) / f"ref-W{world_size}.pt"


def _vacuum(cfg: JobConfig) -> None:
    if dist.get_rank() == 0:
        try:
            urllib.request.urlopen(cfg.store.vacuum_url, timeout=120).read()  # type: ignore[union-attr]
        except OSError as exc:
            print(f"(vacuum failed: {exc})", flush=True)


class _UploadClock:
    """Seconds spent in ``ObjectStore.upload`` (this rank), per call of the method it wraps."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self._current = 0.0
        original = ObjectStore.upload

        def timed(store: ObjectStore, local: Path, name: str) -> None:
            start = time.perf_counter()
            try:
                original(store, local, name)
            finally:
                self._current += time.perf_counter() - start

        ObjectStore.upload = timed  # type: ignore[method-assign]

    def wrap(self, method: Method) -> Method:
        def call() -> Any:
            self._current = 0.0
            try:
                return method.call()
            finally:
                self.calls.append(self._current)

        return Method(call, method.check, method.prepare, method.finish)


def _floors(cfg: JobConfig, model: Any, optim: Any, rank: int, world_size: int) -> tuple[dict[str, Method], dict[str, Method]]:
    """The save and the load floor of this backend."""
    if cfg.store is None:
        directory = Path(cfg.work) / "floor"
        directory.mkdir(parents=True, exist_ok=True)
        return ({"floor_save": Method(lambda: floors.save(floors.own_state(model, optim), directory, rank))},
                {"floor_load": Method(lambda: floors.load(floors.rank_file(directory, rank)))})  # fmt: skip
    from ..storage import floors as store_floors

    fs, data = cfg.store.root.fs, store_floors.blob(model, optim)
    key = cfg.store.root.key(f"{scratch(world_size)['floor']}/rank{rank}")
    return ({"floor_upload": Method(lambda: store_floors.upload(fs, key, data))},
            {"floor_download": Method(lambda: store_floors.download(fs, key, len(data)))})  # fmt: skip


def run(rank: int, world_size: int, cfg: JobConfig) -> dict[str, Any] | None:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    model, optim = cfg.build(models.wrap_fairscale, rank)
    own = cfg.checkpoint(world_size)
    if cfg.source_only:
        fsdp_optim.save_checkpoint(model, optim, own)
        publish({cfg.reference(world_size): ours.reference(model, optim)} if cfg.publish_ref else {})
        return None
    fsdp2 = cfg.build(models.wrap_fsdp2, rank)
    nested = models.wrap_fairscale_linears(cfg.model, torch.device("cpu")) if cfg.other else None
    group = dist.new_group(backend="gloo") if cfg.store is None else None  # DCP async's own group
    timings["build_train_s"] = time.perf_counter() - start
    work, store = Path(cfg.work), cfg.store
    where = {name: store.root.child(prefix) for name, prefix in scratch(world_size).items()} if store else {name: work / name for name in ("dcp", "whole-async")}
    dcp_where = whole_dcp.location(url=where["dcp"].url, options=store.storage_options) if store else whole_dcp.location(where["dcp"])  # type: ignore[union-attr]
    full_file, clock = work / "fullsd.pt", _UploadClock() if store else None
    floor_saves, floor_loads = _floors(cfg, model, optim, rank, world_size)
    slow = {"warmup": 0, "repeats": cfg.peer_repeats}
    results: dict[str, Any] = {}

    phase, probes = time.perf_counter(), Probes()
    saves = floor_saves | ours.save_methods(model, optim, directory=own, async_dir=where["whole-async"], probes=probes)
    if clock is not None:
        saves["whole_save"] = clock.wrap(saves["whole_save"])
        saves |= whole_dcp.save_methods(*fsdp2, where=dcp_where, probes=probes)
        saves = {name: Method(m.call, m.check, lambda: _vacuum(cfg), m.finish) for name, m in saves.items()}
    else:
        saves |= whole_dcp.save_methods(*fsdp2, where=dcp_where, async_dir=work / "dcp-async", group=group, probes=probes)
    results |= cfg.measure(saves, probes)
    if store is None:
        results |= cfg.measure(fullsd.save_methods(model, optim, path=full_file), Probes(), **slow)
    publish({cfg.reference(world_size): ours.reference(model, optim)} if cfg.publish_ref else {})
    timings["saves_s"] = time.perf_counter() - phase
    disk = {} if store else _disk({"floor_save": work / "floor", "whole_save": own, "dcp_save": where["dcp"], "fullsd_save": full_file})
    for name in ("dcp-async", "whole-async") if store is None and rank == 0 else ():
        remove(work / name)

    phase, probes = time.perf_counter(), Probes()
    loads = floor_loads | ours.load_same(model, optim, directory=own, probes=probes)
    loads |= whole_dcp.load_same(*fsdp2, where=dcp_where, probes=probes)
    if cfg.other is not None and nested is not None:
        loads |= ours.load_other(nested, directory=cfg.checkpoint(cfg.other), reference_file=cfg.reference(cfg.other), probes=probes)
    elif store is None:
        results["whole_load_other"] = NotAvailable("not measured: needs two world sizes (--world-sizes)")
    results |= cfg.measure(loads, probes)
    if store is None:
        probes = Probes()
        results |= cfg.measure(fullsd.load_methods(model, path=full_file, probes=probes), probes, **slow)
    timings["loads_s"] = time.perf_counter() - phase
    return _payload(cfg, rank, world_size, (model, optim, nested), own, results, disk, timings, clock)


def _payload(cfg: JobConfig, rank: int, world_size: int, models_: tuple[Any, Any, Any], own: Any, results: dict[str, Any],
             disk: dict[str, int], timings: dict[str, float], clock: _UploadClock | None) -> dict[str, Any] | None:  # fmt: skip
    """Collective: each rank's own shard bytes (and on the store, the counted re-cut load and the upload times); rank
    0's payload."""
    model, optim, nested = models_
    mine: dict[str, Any] = {"own": floors.own_bytes(model, optim), "nested": floors.own_bytes(nested, None) if nested else 0}
    if cfg.store is not None:
        mine |= {"held": None, "upload_s": clock.calls[cfg.warmup :]}  # type: ignore[union-attr]
        if cfg.other is not None and nested is not None:
            fresh = torch.optim.Adam(nested.parameters(), lr=models.LR)
            dist.barrier()
            fsdp_optim.load_checkpoint(nested, fresh, cfg.store.checkpoint(cfg.other, counted=True))
            mine["held"] = floors.own_bytes(nested, fresh)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    dist.barrier()
    if rank != 0:
        return None
    out = {"results": results, "timings": timings, "other_world_size": cfg.other}
    if cfg.store is None:
        return out | {"disk": disk, "own_bytes": {key: [e[key] for e in everyone] for key in ("own", "nested")}}
    held = [e["held"] for e in everyone]
    return out | {
        "own_bytes": [e["own"] for e in everyone],
        "recut_held_bytes": sum(held) if held[0] is not None else None,
        "upload_s": [max(e["upload_s"][k] for e in everyone) for k in range(min(len(e["upload_s"]) for e in everyone))],
        "objects": {name: o.size for name, o in own.listing().items()},
    }


def _disk(paths: dict[str, Path]) -> dict[str, int]:
    dist.barrier()
    return {name: disk_bytes(path) for name, path in paths.items() if path.exists()} if dist.get_rank() == 0 else {}


__all__ = ["JobConfig", "Store", "run", "scratch"]
