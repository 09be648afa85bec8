"""The timing job of the A/B, run on each of 2 gloo ranks with one side's ``fsdp_optim`` first on ``sys.path``.

``run(rank, world_size, model, repeats, work)`` trains the model for 2 steps, then times every op of ``OPS`` in that
order, each call between two barriers, and returns ``{op: median seconds}`` (``work`` is a dict: ``checkout``, the
side's checkout its ``fsdp_optim`` must come from; ``out``, a scratch directory; ``store_url`` and
``storage_options``, an empty prefix of the runner's S3 server; ``memory_dir``, an empty tmpfs directory). The ops,
by path:

    POSIX    gather, get_shard, save, load, load_recut, scatter, consolidate, reshard (the optimizer-state API on a
             local directory; load_recut into another nesting, scatter of a full dict, the offline two on rank 0)
    whole    ``save_checkpoint`` / ``load_checkpoint`` of the whole state (model, optimizer, extra) on each
             backend, the same calls: local_save / local_load (a local directory), fsspec_save / fsspec_load
             (the fsspec backend on fsspec's local filesystem, ``open_store("local://DIR", auto_mkdir=True)``: the
             store code without a network; ``memory://`` lives in one process, which two ranks cannot share, and
             ``file://`` is a local path), store_save / store_load (the S3 server through
             ``open_store(store_url, **storage_options)``: uploads, ranged reads, the conditional-put commit); one
             untimed call first on each store
    memory   memory_save (what ``CheckpointManager.save`` of a memory step blocks for; its ``wait()`` untimed),
             memory_save_total (save and wait), memory_restore (``CheckpointManager.restore`` from the tiers of
             the 2 nodes, one rank each, 1 replica)
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPS = (
    "gather", "get_shard", "save", "load", "load_recut", "scatter", "consolidate", "reshard",
    "local_save", "local_load", "fsspec_save", "fsspec_load",
    "store_save", "store_load", "memory_save", "memory_save_total", "memory_restore",
)  # fmt: skip
# Untimed calls first: the store's first request of a process sets up its client (credentials, connections).
WARMUP = {"fsspec_save": 1, "fsspec_load": 1, "store_save": 1, "store_load": 1}
Op = tuple[Callable[[], object], Callable[[], object] | None]  # the timed call, and what runs untimed after it


def _package(checkout: str) -> Any:
    """The ``fsdp_optim`` this rank imports, refused unless it is ``checkout``'s."""
    import fsdp_optim

    found = Path(fsdp_optim.__file__).resolve()
    if not found.is_relative_to(Path(checkout).resolve()):
        raise RuntimeError(f"engine_ab: this side's job imported fsdp_optim from {found}, expected it under {checkout}")
    return fsdp_optim


def _posix_ops(fsdp_optim: Any, rank: int, spec: Any, model: Any, optim: Any, fresh: Any, out: str) -> dict[str, Op]:
    import torch

    from benchmarks.models import build

    other = fsdp_optim.FullyShardedDataParallel(build(spec, torch.device("cpu")), flatten_parameters=True)  # one unit
    fresh_other = torch.optim.Adam(other.parameters(), lr=1e-3)
    ckpt = os.path.join(out, "ckpt")
    full = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    calls: dict[str, Callable[[], object]] = {
        "gather": lambda: model.gather_full_optim_state_dict(optim),
        "get_shard": lambda: model.get_shard_from_optim_state_dict(full, optim=optim),
        "save": lambda: fsdp_optim.save_sharded_optim_state(model, optim, ckpt),
        "load": lambda: fsdp_optim.load_sharded_optim_state(model, fresh, ckpt),
        "load_recut": lambda: fsdp_optim.load_sharded_optim_state(other, fresh_other, ckpt),
        "scatter": lambda: fsdp_optim.scatter_full_optim_state(model, fresh, full if rank == 0 else None),
        "consolidate": lambda: fsdp_optim.consolidate(ckpt) if rank == 0 else None,
        "reshard": lambda: fsdp_optim.reshard(ckpt, 3, os.path.join(out, "r3")) if rank == 0 else None,
    }
    return {name: (call, None) for name, call in calls.items()}


def _whole_ops(fsdp_optim: Any, model: Any, optim: Any, fresh: Any, work: dict[str, Any]) -> dict[str, Op]:
    """``save_checkpoint`` and ``load_checkpoint`` of the same state on each backend (module docstring)."""
    backends = {
        "local": os.path.join(work["out"], "whole"),
        "fsspec": fsdp_optim.open_store(f"local://{os.path.join(work['out'], 'fsspec')}", auto_mkdir=True),
        "store": fsdp_optim.open_store(work["store_url"], **work["storage_options"]),
    }
    ops: dict[str, Op] = {}
    for name, target in backends.items():
        ops[f"{name}_save"] = (lambda t=target: fsdp_optim.save_checkpoint(model, optim, t, extra={"step": 0}), None)
        ops[f"{name}_load"] = (lambda t=target: fsdp_optim.load_checkpoint(model, fresh, t), None)
    return ops


def _memory_ops(fsdp_optim: Any, rank: int, model: Any, optim: Any, fresh: Any, work: dict[str, Any]) -> dict[str, Op]:
    # Nothing durable is ever saved (every=10**7): each step goes to the memory tier, each rank its own node.
    manager = fsdp_optim.CheckpointManager(
        os.path.join(work["out"], "durable"), every=10**7, keep=1, memory_every=1, replicas=1,
        memory_dir=work["memory_dir"], node=rank,
    )  # fmt: skip
    step = itertools.count(1)
    save_memory = lambda: manager.save(next(step), model, optim, extra={"step": 0})  # noqa: E731

    def restore() -> None:
        manager.restore(model, fresh)
        if manager.restored_from != "memory":
            raise RuntimeError(f"engine_ab: CheckpointManager.restore loaded from {manager.restored_from}, not the memory tier")

    return {
        "memory_save": (save_memory, manager.wait),
        "memory_save_total": (lambda: (save_memory(), manager.wait()), None),
        "memory_restore": (restore, None),
    }


def _medians(ops: dict[str, Op], repeats: int) -> dict[str, float]:
    """Each op's median over ``repeats`` calls (after ``WARMUP``), in ``OPS`` order, every call between two barriers."""
    import torch.distributed as dist

    medians = {}
    for name in OPS:
        call, after = ops[name]
        times = []
        for _ in range(WARMUP.get(name, 0) + repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
            if after is not None:
                after()
        dist.barrier()
        medians[name] = statistics.median(times[WARMUP.get(name, 0) :])
    return medians


def run(rank: int, world_size: int, model_name: str, repeats: int, work: dict[str, Any]) -> dict[str, float]:
    """One side's job on one rank: ``{op: median seconds}`` for every op of ``OPS``."""
    import torch

    from benchmarks.models import parse_model, train, wrap_fairscale

    fsdp_optim = _package(work["checkout"])
    spec = parse_model(model_name)
    model = wrap_fairscale(spec, torch.device("cpu"))
    optim = train(model, spec, 2, rank, torch.device("cpu"))
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    ops = _posix_ops(fsdp_optim, rank, spec, model, optim, fresh, work["out"])
    ops |= _whole_ops(fsdp_optim, model, optim, fresh, work)
    ops |= _memory_ops(fsdp_optim, rank, model, optim, fresh, work)
    return _medians(ops, repeats)
