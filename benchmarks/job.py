"""The one job runner of the checkpoint benchmarks: what every rank runs for one world size, on a local directory or
an S3 store, of the optimizer state only (``run_optim``: ``python -m benchmarks.checkpoint``) or of the whole state
(``run_whole``: ``python -m benchmarks.whole_state``, and ``python -m benchmarks.storage`` on the store).

Both build the model as fsdp_optim's (fairscale) FSDP, a unit per block, and as FSDP2 and train each the same Adam
steps; a ``source_only`` job then only saves its checkpoints and writes the references beside them, for the jobs of
other world sizes that load them (``spawn.campaign``). Otherwise, in phases, methods interleaved within each:

1. Saves: the floor, ours sync and async (timed: the blocking call; recorded: until its handle's ``wait()`` returns),
   DCP ``dcp.save`` and (locally) ``dcp.async_save`` on a gloo group of its own. This job's sync checkpoints stay for
   the loads and, when ``publish_ref``, for a later job of another world size, with the references written beside
   them. Optimizer state: the floor is each rank's ``torch.save`` + fsync of ``optim.state_dict()``; the checks
   consolidate each save and compare it with the gathered full dict. Whole state: locally the floor saves the rank's
   weight shards and optimizer state the same way, and fairscale's full ``state_dict()`` save follows (few calls, for
   its peak RSS); on the store the floor is one ``storage/floors.py`` upload of the rank's state bytes, DCP writes
   through ``FsspecWriter``, rank 0 has the server compact what the call before replaced before each call (untimed)
   and each rank records how long its uploads (``ObjectStore.write`` of a local file) took inside each
   ``save_checkpoint``.
2. Loads into fresh optimizers (whole state: and zeroed weights): the floor (each rank's file, or its bytes fetched),
   ours and DCP from this job's checkpoints and ours (optimizer state: DCP too) from another world size's, the
   whole state into the model at another FSDP nesting (a unit per Linear). Locally, fairscale's full
   ``load_state_dict()`` follows; on the store one more other-W load, untimed, through the counting proxy
   (``Store.counted``): the parent reads how many bytes the server sent.
3. Optimizer state only: offline on rank 0, consolidate + save against ``dcp_to_torch_save`` and the
   read-everything-write-everything floor, reshard to another world size against its floor; then training
   throughput with and without checkpoints (``ckpt/train.py``), last, since it changes the state.
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

from . import models
from .ckpt import dcp as ckpt_dcp
from .ckpt import floors
from .ckpt import ours as ckpt_ours
from .ckpt import train as ckpt_train
from .ckpt.common import Job, Loads, Probes, disk_bytes, measured_and_removed, phase, publish, remove
from .measure import Method, NotAvailable, release_memory, tensor_bytes
from .whole import fullsd


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
    publish_ref: bool  # a later job loads this job's checkpoints: write the references
    other: int | None  # load the checkpoints saved at this world size (optimizer state: and reshard to it)
    store: Store | None = None  # None: checkpoints in ``work``'s parent directory
    peer_repeats: int = 0  # whole state: calls of fairscale's full state dict save and load (local only; no warm-up)
    train: ckpt_train.TrainConfig | None = None  # optimizer state: the training runs
    skip_train: str = ""  # why training runs are not measured here (reported as n/a)
    source_only: bool = False

    def checkpoint(self, world_size: int, name: str = "whole") -> Any:
        """Where the job of ``world_size`` keeps its ``name`` checkpoint (whole, ours, dcp)."""
        return self.store.checkpoint(world_size) if self.store else Path(self.work).parent / f"{name}-W{world_size}"

    def reference(self, world_size: int, name: str = "ref") -> Path:
        """The reference a load of that checkpoint must equal (ref, ref-ours, ref-dcp)."""
        return Path(self.refs) / f"{name}-W{world_size}.pt"


def _vacuum(cfg: JobConfig) -> None:
    if dist.get_rank() == 0:
        try:
            urllib.request.urlopen(cfg.store.vacuum_url, timeout=120).read()  # type: ignore[union-attr]
        except OSError as exc:
            print(f"(vacuum failed: {exc})", flush=True)


class _UploadClock:
    """Seconds spent uploading local files (``ObjectStore.write`` of a ``Path``: this rank), per call of the method
    it wraps."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self._current = 0.0
        original = ObjectStore.write

        def timed(store: ObjectStore, name: str, data: bytes | Path) -> None:
            start = time.perf_counter()
            try:
                original(store, name, data)
            finally:
                if isinstance(data, Path):
                    self._current += time.perf_counter() - start

        ObjectStore.write = timed  # type: ignore[method-assign,assignment]

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
    from .storage import floors as store_floors

    fs, data = cfg.store.root.fs, store_floors.blob(model, optim)
    key = cfg.store.root.key(f"{scratch(world_size)['floor']}/rank{rank}")
    return ({"floor_upload": Method(lambda: store_floors.upload(fs, key, data))},
            {"floor_download": Method(lambda: store_floors.download(fs, key, len(data)))})  # fmt: skip


def run_whole(rank: int, world_size: int, cfg: JobConfig) -> dict[str, Any] | None:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    model, optim = cfg.build(models.wrap_fairscale, rank)
    own = cfg.checkpoint(world_size)
    if cfg.source_only:
        fsdp_optim.save_checkpoint(model, optim, own)
        publish({cfg.reference(world_size): ckpt_ours.whole_reference(model, optim)} if cfg.publish_ref else {})
        return None
    fsdp2 = cfg.build(models.wrap_fsdp2, rank)
    nested = models.wrap_fairscale_linears(cfg.model, torch.device("cpu")) if cfg.other else None
    group = dist.new_group(backend="gloo") if cfg.store is None else None  # DCP async's own group
    timings["build_train_s"] = time.perf_counter() - start
    work, store = Path(cfg.work), cfg.store
    where: dict[str, Any] = {name: store.root.child(prefix) for name, prefix in scratch(world_size).items()} if store else {name: work / name for name in ("dcp", "whole-async")}
    dcp_where = ckpt_dcp.location(url=where["dcp"].url, options=store.storage_options) if store else ckpt_dcp.location(where["dcp"])  # type: ignore[union-attr]
    full_file, clock = work / "fullsd.pt", _UploadClock() if store else None
    floor_saves, floor_loads = _floors(cfg, model, optim, rank, world_size)
    slow = {"warmup": 0, "repeats": cfg.peer_repeats}
    results: dict[str, Any] = {}

    phase, probes = time.perf_counter(), Probes()
    saves = floor_saves | ckpt_ours.whole_save_methods(model, optim, directory=own, async_dir=where["whole-async"], probes=probes)
    if clock is not None:
        saves["whole_save"] = clock.wrap(saves["whole_save"])
        saves |= ckpt_dcp.whole_save_methods(*fsdp2, where=dcp_where, probes=probes)
        saves = {name: Method(m.call, m.check, lambda: _vacuum(cfg), m.finish) for name, m in saves.items()}
    else:
        saves |= ckpt_dcp.whole_save_methods(*fsdp2, where=dcp_where, async_dir=work / "dcp-async", group=group, probes=probes)
    results |= cfg.measure(saves, probes)
    if store is None:
        results |= cfg.measure(fullsd.save_methods(model, optim, path=full_file), Probes(), **slow)
    publish({cfg.reference(world_size): ckpt_ours.whole_reference(model, optim)} if cfg.publish_ref else {})
    timings["saves_s"] = time.perf_counter() - phase
    disk = {} if store else _disk({"floor_save": work / "floor", "whole_save": own, "dcp_save": where["dcp"], "fullsd_save": full_file})
    for name in ("dcp-async", "whole-async") if store is None and rank == 0 else ():
        remove(work / name)

    phase, probes = time.perf_counter(), Probes()
    loads = floor_loads | ckpt_ours.whole_load_same(model, optim, directory=own, probes=probes)
    loads |= ckpt_dcp.whole_load_same(*fsdp2, where=dcp_where, probes=probes)
    if cfg.other is not None and nested is not None:
        loads |= ckpt_ours.whole_load_other(nested, directory=cfg.checkpoint(cfg.other), reference_file=cfg.reference(cfg.other), probes=probes)
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


def _references(cfg: JobConfig, world_size: int, refs: tuple[Any, Any]) -> None:
    publish({cfg.reference(world_size, "ref-ours"): refs[0], cfg.reference(world_size, "ref-dcp"): refs[1]} if cfg.publish_ref else {})


def run_optim(rank: int, world_size: int, cfg: JobConfig) -> dict[str, Any] | None:
    timings: dict[str, float] = {}
    with phase(timings, "build_train_s"):
        ours = cfg.build(models.wrap_fairscale, rank)
        fsdp2 = cfg.build(models.wrap_fsdp2, rank)
        group = dist.new_group(backend="gloo")  # DCP async's own group: its thread's collectives stay apart
        refs = (ours[0].gather_full_optim_state_dict(ours[1]), ckpt_dcp.full_state(*fsdp2))
        full_bytes = tensor_bytes(refs[0]) if rank == 0 else 0  # the full Adam state, padding excluded
    if cfg.source_only:
        fsdp_optim.save_sharded_optim_state(*ours, cfg.checkpoint(world_size, "ours"))
        ckpt_dcp.save(*fsdp2, cfg.checkpoint(world_size, "dcp"))
        _references(cfg, world_size, refs)
        return None
    floor_dir = Path(cfg.work) / "floor"
    floor_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    disk: dict[str, int] = {}
    with phase(timings, "saves_s"):
        results |= _saves(cfg, ours, fsdp2, group, refs, disk)
    with phase(timings, "loads_s"):
        probes = Probes()
        loads = {"floor_load": Method(lambda: floors.load(floors.rank_file(floor_dir, rank)))}
        for module, pair, name in ((ckpt_ours, ours, "ours"), (ckpt_dcp, fsdp2, "dcp")):
            other = cfg.other is not None
            where = Loads(cfg.checkpoint(world_size, name), cfg.checkpoint(cfg.other, name) if other else None,  # type: ignore[arg-type]
                          cfg.reference(cfg.other, f"ref-{name}") if other else None, probes)  # type: ignore[arg-type]
            loads |= module.load_methods(*pair, where)
        results |= cfg.measure(loads, probes)
    with phase(timings, "offline_s"):
        results |= cfg.measure(_offline(cfg, floor_dir, refs, disk))
    dist.barrier()
    if rank == 0:
        remove(floor_dir)
    refs = (None, None)  # type: ignore[assignment]
    release_memory()
    if cfg.train is not None:
        with phase(timings, "train_s"):
            results |= _train(cfg, ours, fsdp2, group, results, disk)
    elif cfg.skip_train:
        results |= {name: NotAvailable(cfg.skip_train) for name in ckpt_train.VARIANTS}
    if rank != 0:
        return None
    train = None if cfg.train is None else {"steps": cfg.train.steps, "checkpoints": cfg.train.checkpoints}
    state_bytes = sum(s.untyped_storage().nbytes() for s in _state_tensors(ours[1]))
    return dict(results=results, disk=disk, timings=timings, full_bytes=full_bytes, rank_state_bytes=state_bytes, other_world_size=cfg.other, reshard_to=cfg.other, train=train)


def _saves(cfg: JobConfig, ours: Any, fsdp2: Any, group: Any, refs: tuple[Any, Any], disk: dict[str, int]) -> dict[str, Any]:
    """The floor, our sync and async saves and DCP's, interleaved; this job's sync checkpoints stay for the loads."""
    rank, world_size, work, probes = dist.get_rank(), dist.get_world_size(), Path(cfg.work), Probes()
    mine, theirs = cfg.checkpoint(world_size, "ours"), cfg.checkpoint(world_size, "dcp")
    saves = {"floor_save": Method(lambda: floors.save(ours[1].state_dict(), work / "floor", rank))}
    saves |= ckpt_ours.save_methods(*ours, same_dir=mine, async_dir=work / "ours-async", reference=refs[0], probes=probes)
    saves |= ckpt_dcp.save_methods(*fsdp2, same_dir=theirs, async_dir=work / "dcp-async", group=group, reference=refs[1], probes=probes)
    results = cfg.measure(saves, probes)
    _references(cfg, world_size, refs)
    if rank == 0:
        for name, path in (("floor_save", work / "floor"), ("ours_save", mine), ("dcp_save", theirs), ("ours_async", work / "ours-async"), ("dcp_async", work / "dcp-async")):
            if path.exists():
                disk[name] = disk_bytes(path)
                if name.endswith("async"):
                    remove(path)
    return results


def _train(cfg: JobConfig, ours: Any, fsdp2: Any, group: Any, results: dict[str, Any], disk: dict[str, int]) -> dict[str, Any]:
    """Training throughput with and without checkpoints; last, since it changes the state."""
    work = Path(cfg.work)
    assert cfg.train is not None, "_train without a training configuration"
    trained = cfg.measure(ckpt_train.methods(cfg.train, cfg.model, ours, fsdp2, work=work, group=group), warmup=0, repeats=cfg.train.repeats)
    if dist.get_rank() == 0:
        for name in ("train-ours", "train-ours-async", "train-dcp", "train-dcp-async"):
            if (work / name).exists():
                disk[name.replace("-", "_")] = disk_bytes(work / name)
    return trained


def _offline(cfg: JobConfig, floor_dir: Path, refs: tuple[Any, Any], disk: dict[str, int]) -> dict[str, Method]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    work = Path(cfg.work)
    files = [floors.rank_file(floor_dir, r) for r in range(world_size)]
    numel, dtype = floors.state_numel(files) if rank == 0 else (0, torch.float32)

    def floor(parts: int, out: Path, name: str) -> Method:
        call = lambda: floors.read_all_write_all(files, parts, out, numel=numel, dtype=dtype) if rank == 0 else None  # noqa: E731
        return Method(call, finish=measured_and_removed(disk, name, out))

    methods = {"floor_consolidate": floor(1, work / "floor-full", "floor_consolidate")}
    methods |= ckpt_ours.offline_methods(
        same_dir=cfg.checkpoint(world_size, "ours"), out_dir=work, reshard_to=cfg.other, reference=refs[0], disk=disk
    )
    methods |= ckpt_dcp.offline_methods(same_dir=cfg.checkpoint(world_size, "dcp"), out_dir=work, reference=refs[1], disk=disk)
    if cfg.other is not None:
        methods["floor_reshard"] = floor(cfg.other, work / "floor-resharded", "floor_reshard")
    return methods


def _state_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]



def _disk(paths: dict[str, Path]) -> dict[str, int]:
    dist.barrier()
    return {name: disk_bytes(path) for name, path in paths.items() if path.exists()} if dist.get_rank() == 0 else {}


__all__ = ["JobConfig", "Store", "run_optim", "run_whole", "scratch"]
