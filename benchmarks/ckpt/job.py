"""What every rank runs for one (model, world size) of the checkpoint benchmark.

1. Build the model twice, as fsdp_optim's (fairscale) FSDP and as FSDP2, and train each the same Adam
   steps; take the references the checks compare with (our gathered full dict, DCP's full state dict).
2. Saves, interleaved: the per-rank floor, ours, ours async, DCP, DCP async.
   This job's sync checkpoints stay on disk for step 3 and, when ``publish_refs``, for a later job
   of another world size, with the references written beside them.
3. Loads into fresh optimizers, interleaved: the floor, ours and DCP from this job's checkpoints and from
   those of another world size.
4. Offline on rank 0, interleaved: consolidate + save against ``dcp_to_torch_save`` and the
   read-everything-write-everything floor; reshard to another world size against its floor.
5. Training throughput with and without checkpoints (``ckpt_train``); last, since it changes the state.

A ``source_only`` job does step 1 and writes its checkpoints and references, for a job that runs before
any other job of that world size (see ``checkpoint.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import models
from ..measure import Measurement, Method, NotAvailable, release_memory, tensor_bytes
from . import dcp as ckpt_dcp
from . import floors as ckpt_floors
from . import ours as ckpt_ours
from . import train as ckpt_train
from .common import Job, Loads, Probes, disk_bytes, measured_and_removed, phase, publish, remove


@dataclass(frozen=True)
class Source:
    """Where a job of ``world_size`` ranks keeps its sync checkpoints and the references they must equal."""

    world_size: int
    ours: str
    dcp: str
    ref_ours: str
    ref_dcp: str


@dataclass(frozen=True)
class JobConfig(Job):
    work: str  # this job's scratch directory (removed by the caller)
    own: Source  # this job's world size
    publish_refs: bool  # a later job loads ``own``: write the references
    other: Source | None  # checkpoints saved at another world size, to load here
    reshard_to: int | None
    train: ckpt_train.TrainConfig | None
    source_only: bool = False
    skip_train: str = ""  # why training runs are not measured here (reported as n/a)



def _publish(cfg: JobConfig, ours: tuple[Any, Any], fsdp2: tuple[Any, Any], refs: tuple[Any, Any]) -> None:
    import fsdp_optim

    fsdp_optim.save_sharded_optim_state(*ours, cfg.own.ours)
    ckpt_dcp.save(*fsdp2, Path(cfg.own.dcp))
    publish({cfg.own.ref_ours: refs[0], cfg.own.ref_dcp: refs[1]} if cfg.publish_refs else {})


def run(rank: int, world_size: int, cfg: JobConfig) -> dict[str, Any] | None:
    timings: dict[str, float] = {}
    with phase(timings, "build_train_s"):
        ours = cfg.build(models.wrap_fairscale, rank)
        fsdp2 = cfg.build(models.wrap_fsdp2, rank)
        group = dist.new_group(backend="gloo")  # DCP async's own group: its thread's collectives stay apart
        refs = (ours[0].gather_full_optim_state_dict(ours[1]), ckpt_dcp.full_state(*fsdp2))
        full_bytes = tensor_bytes(refs[0]) if rank == 0 else 0  # the full Adam state, padding excluded
    if cfg.source_only:
        _publish(cfg, ours, fsdp2, refs)
        return None
    floor_dir = Path(cfg.work) / "floor"
    floor_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    disk: dict[str, int] = {}
    with phase(timings, "saves_s"):
        results |= _saves(cfg, ours, fsdp2, group, refs, disk)
    with phase(timings, "loads_s"):
        probes = Probes()
        loads = {"floor_load": Method(lambda: ckpt_floors.load(ckpt_floors.rank_file(floor_dir, rank)))}
        own, other = cfg.own, cfg.other
        for module, pair, same, there, ref in (
            (ckpt_ours, ours, own.ours, other and other.ours, other and other.ref_ours),
            (ckpt_dcp, fsdp2, own.dcp, other and other.dcp, other and other.ref_dcp),
        ):
            loads |= module.load_methods(*pair, Loads(Path(same), Path(there) if there else None, Path(ref) if ref else None, probes))
        results |= cfg.measure(loads, probes)
    with phase(timings, "offline_s"):
        results |= cfg.measure(_offline(cfg, floor_dir, refs, disk))
    dist.barrier()
    if rank == 0:
        remove(floor_dir)
    refs = (None, None)
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
    other_world_size = other.world_size if other else None
    return dict(results=results, disk=disk, timings=timings, full_bytes=full_bytes, rank_state_bytes=state_bytes, other_world_size=other_world_size, reshard_to=cfg.reshard_to, train=train)


def _saves(cfg: JobConfig, ours: Any, fsdp2: Any, group: Any, refs: tuple[Any, Any], disk: dict[str, int]) -> dict[str, Any]:
    """The floor, our sync and async saves and DCP's, interleaved; this job's sync checkpoints stay for the loads."""
    rank, work, own, probes = dist.get_rank(), Path(cfg.work), cfg.own, Probes()
    saves = {"floor_save": Method(lambda: ckpt_floors.save(ours[1].state_dict(), work / "floor", rank))}
    saves |= ckpt_ours.save_methods(*ours, same_dir=Path(own.ours), async_dir=work / "ours-async", reference=refs[0], probes=probes)
    saves |= ckpt_dcp.save_methods(*fsdp2, same_dir=Path(own.dcp), async_dir=work / "dcp-async", group=group, reference=refs[1], probes=probes)
    results = cfg.measure(saves, probes)
    publish({cfg.own.ref_ours: refs[0], cfg.own.ref_dcp: refs[1]} if cfg.publish_refs else {})
    if rank == 0:
        for name, path in (("floor_save", work / "floor"), ("ours_save", Path(own.ours)), ("dcp_save", Path(own.dcp)), ("ours_async", work / "ours-async"), ("dcp_async", work / "dcp-async")):
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
    files = [ckpt_floors.rank_file(floor_dir, r) for r in range(world_size)]
    numel, dtype = ckpt_floors.state_numel(files) if rank == 0 else (0, torch.float32)

    def floor(parts: int, out: Path, name: str) -> Method:
        call = lambda: ckpt_floors.read_all_write_all(files, parts, out, numel=numel, dtype=dtype) if rank == 0 else None  # noqa: E731
        return Method(call, finish=measured_and_removed(disk, name, out))

    methods = {"floor_consolidate": floor(1, work / "floor-full", "floor_consolidate")}
    methods |= ckpt_ours.offline_methods(
        same_dir=Path(cfg.own.ours), out_dir=work, reshard_to=cfg.reshard_to, reference=refs[0], disk=disk
    )
    methods |= ckpt_dcp.offline_methods(same_dir=Path(cfg.own.dcp), out_dir=work, reference=refs[1], disk=disk)
    if cfg.reshard_to is not None:
        methods["floor_reshard"] = floor(cfg.reshard_to, work / "floor-resharded", "floor_reshard")
    return methods


def _state_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


__all__ = ["JobConfig", "Measurement", "Source", "run"]
