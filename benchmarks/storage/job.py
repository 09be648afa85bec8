"""What every rank runs for one world size of the object-storage benchmark.

1. Build the model as fsdp_optim's (fairscale) FSDP (a unit per block) and as FSDP2, train each the same Adam steps;
   build it a third time at another nesting (a unit per Linear) for the other-W load.
2. Saves to the store, interleaved: the upload floor (``floors.upload`` of the rank's state bytes), ``save_checkpoint``,
   ``async_save_checkpoint`` (timed: the blocking call; recorded: until ``wait()`` returns, the checkpoint committed)
   and DCP's ``dcp.save`` through ``FsspecWriter`` with the same URL scheme and storage options. Before each call rank 0
   has the server compact what the call before replaced (untimed).
3. Loads from the store, interleaved: the download floor, ``load_checkpoint`` at this world size, DCP's ``dcp.load``
   through ``FsspecReader`` + ``set_state_dict``, and ``load_checkpoint`` of a checkpoint saved at another world size
   into the other nesting (checked against the saving job's reference).
4. One more other-W load, untimed, through the counting proxy (``cfg.counted``): the parent reads how many bytes the
   server sent for it; every rank reports the bytes of state it holds after it.

A ``source_only`` job trains, saves its checkpoint and writes the reference, for the job that loads it.
Each rank also records how long ``ObjectStore.upload`` took inside each ``save_checkpoint`` (the upload part of it;
the rest is the local staging write and the commit).
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
from ..ckpt import floors as whole_floors
from ..ckpt.common import Job, Probes, publish
from ..measure import Method
from ..whole import dcp as whole_dcp
from ..whole import ours
from . import floors


@dataclass(frozen=True)
class JobConfig(Job):
    root: ObjectStore  # this run's prefix, straight to the server
    counted: ObjectStore | None  # the same prefix through the counting proxy: the counted other-W load
    storage_options: dict[str, Any]  # for s3fs, DCP's FsspecWriter / FsspecReader
    refs: str  # local directory of the references
    other: int | None  # load the checkpoint saved at this world size
    publish_ref: bool  # a later job loads this one's checkpoint: write the reference
    vacuum_url: str  # the master's compaction endpoint
    source_only: bool = False


def checkpoint(root: ObjectStore, world_size: int) -> ObjectStore:
    return root.child(f"whole-W{world_size}")


def scratch(world_size: int) -> dict[str, str]:
    """The prefixes of a job's other saves, under names of its own (a removed prefix may leave a marker behind)."""
    return {name: f"{name}-W{world_size}" for name in ("floor", "dcp", "whole-async")}


def reference(refs: str, world_size: int) -> Path:
    return Path(refs) / f"ref-W{world_size}.pt"



def _vacuum(cfg: JobConfig) -> None:
    if dist.get_rank() == 0:
        try:
            urllib.request.urlopen(cfg.vacuum_url, timeout=120).read()
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


def run(rank: int, world_size: int, cfg: JobConfig) -> dict[str, Any] | None:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    model, optim = cfg.build(models.wrap_fairscale, rank)
    own = checkpoint(cfg.root, world_size)
    if cfg.source_only:
        fsdp_optim.save_checkpoint(model, optim, own)
        publish({reference(cfg.refs, world_size): ours.reference(model, optim)} if cfg.publish_ref else {})
        return None
    fsdp2 = cfg.build(models.wrap_fsdp2, rank)
    nested = models.wrap_fairscale_linears(cfg.model, torch.device("cpu")) if cfg.other else None
    timings["build_train_s"] = time.perf_counter() - start
    fs = cfg.root.fs
    data = floors.blob(model, optim)
    prefixes = scratch(world_size)
    floor_key = cfg.root.key(f"{prefixes['floor']}/rank{rank}")
    clock = _UploadClock()
    dcp_where, probes = whole_dcp.location(url=cfg.root.child(prefixes["dcp"]).url, options=cfg.storage_options), Probes()

    phase = time.perf_counter()
    compact = lambda method: Method(method.call, method.check, lambda: _vacuum(cfg), method.finish)  # noqa: E731
    saves = {"floor_upload": Method(lambda: floors.upload(fs, floor_key, data))}
    saves |= ours.save_methods(model, optim, directory=own, async_dir=cfg.root.child(prefixes["whole-async"]), probes=probes)  # type: ignore[arg-type]
    saves["whole_save"] = clock.wrap(saves["whole_save"])
    saves |= whole_dcp.save_methods(*fsdp2, where=dcp_where, probes=probes)
    results = cfg.measure({name: compact(m) for name, m in saves.items()}, probes)
    publish({reference(cfg.refs, world_size): ours.reference(model, optim)} if cfg.publish_ref else {})
    timings["saves_s"] = time.perf_counter() - phase

    phase = time.perf_counter()
    probes = Probes()
    loads = {"floor_download": Method(lambda: floors.download(fs, floor_key, len(data)))}
    loads |= ours.load_same(model, optim, directory=own, probes=probes)  # type: ignore[arg-type]
    loads |= whole_dcp.load_same(*fsdp2, where=dcp_where, probes=probes)
    if cfg.other is not None and nested is not None:
        ref = reference(cfg.refs, cfg.other)
        loads |= ours.load_other(nested, directory=checkpoint(cfg.root, cfg.other), reference_file=ref, probes=probes)  # type: ignore[arg-type]
    results |= cfg.measure(loads, probes)
    timings["loads_s"] = time.perf_counter() - phase

    held = None
    if cfg.other is not None and nested is not None and cfg.counted is not None:
        fresh = torch.optim.Adam(nested.parameters(), lr=models.LR)
        dist.barrier()
        fsdp_optim.load_checkpoint(nested, fresh, checkpoint(cfg.counted, cfg.other))
        held = whole_floors.own_bytes(nested, fresh)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, {"own": whole_floors.own_bytes(model, optim), "held": held, "upload_s": clock.calls[cfg.warmup :]})
    dist.barrier()
    if rank != 0:
        return None
    listing = own.listing()
    return {
        "results": results,
        "timings": timings,
        "own_bytes": [e["own"] for e in everyone],
        "recut_held_bytes": sum(e["held"] for e in everyone) if held is not None else None,
        "upload_s": [max(e["upload_s"][k] for e in everyone) for k in range(min(len(e["upload_s"]) for e in everyone))],
        "objects": {name: o.size for name, o in listing.items()},
        "other_world_size": cfg.other,
    }


__all__ = ["JobConfig", "checkpoint", "reference", "run", "scratch"]
