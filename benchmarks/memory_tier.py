"""Benchmark: the memory tier of CheckpointManager (issue 26): its save's blocking part against the async save's,
and a restore after losing one node (4 nodes x 2 ranks -> 3 nodes x 2) against a same-world-size load of the same
bytes from local files in page cache.

    python -m benchmarks.memory_tier              # 25M model (~3-5 min on 2 cores), into benchmarks/results/
    python -m benchmarks.memory_tier --quick      # 5M model, into benchmarks/out/

Job 1 (8 ranks, nodes = rank // 2, replicas=1) trains one step, then per repeat: ``async_save_checkpoint`` (time to
return: its blocking part) and ``manager.save`` of a memory step (time to return; then the save's total through
``wait()``). Node 3's memory directory is then removed. Job 2 (6 ranks on nodes 0-2) restores from the memory tiers
(per repeat from a fresh copy of what survived, though a restore writes nothing there), checks the state is
bit-identical to job 1's, then saves its own 6-rank checkpoint on tmpfs and loads it (the floor: each rank reads its
own files from page cache). Medians of ``REPEATS`` after ``WARMUP``; every rank a process, all on this machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import models, spawn
from .ckpt.common import difference
from .peak import rounds
from .registry import RESULTS, SCRATCH

# ---- configuration ---------------------------------------------------------------------------------
MODEL = "25M"
QUICK_MODEL = "5M"
SAVED_NODES, RANKS_PER_NODE = 4, 2  # job 1: 8 ranks; job 2: one node fewer
WARMUP, REPEATS = 1, 7
STORAGE = Path("/dev/shm")
# -----------------------------------------------------------------------------------------------------


def _median(fn: Any, warmup: int, repeats: int, before: Any = None) -> float:
    """The median of ``fn(k)`` for the timed ``k`` (after ``warmup``), each between two barriers, ``before()`` untimed."""
    import torch.distributed as dist

    k = itertools.count()
    return statistics.median(rounds({"call": lambda: fn(next(k))}, warmup=warmup, repeats=repeats, sync=dist.barrier, before=before and (lambda _: before()))["call"])


def _setup(rank: int, spec: models.ModelSpec, work: str) -> tuple[Any, Any, Any]:
    """The model trained one step, and a CheckpointManager with a memory tier (this rank's node: ``rank // 2``)."""
    import fsdp_optim

    model = models.wrap_fairscale(spec, torch.device("cpu"))
    optim = models.train(model, spec, 1, rank, torch.device("cpu"))
    manager = fsdp_optim.CheckpointManager(Path(work) / "durable", every=10**7, keep=1, memory_every=1, replicas=1,
                                           memory_dir=Path(work) / "memory", node=rank // RANKS_PER_NODE)  # fmt: skip
    return model, optim, manager


def _save_job(rank: int, world_size: int, spec: models.ModelSpec, work: str, warmup: int, repeats: int) -> Any:
    import torch.distributed as dist

    import fsdp_optim

    model, optim, manager = _setup(rank, spec, work)
    handles: list[Any] = []

    def async_save(k: int) -> None:
        handles.append(fsdp_optim.async_save_checkpoint(model, optim, Path(work) / "async", extra={"k": k}))

    def wait_async() -> None:
        for h in handles:
            h.wait()
        handles.clear()

    blocking_async = _median(async_save, warmup, repeats, before=wait_async)
    wait_async()
    blocking_memory = _median(lambda k: manager.save(k + 1, model, optim, extra={"step": k + 1}), warmup, repeats,
                              before=manager.wait)  # fmt: skip
    total_memory = _median(lambda k: (manager.save(100 + k, model, optim, extra={"step": 100 + k}), manager.wait()),
                           warmup, repeats)  # fmt: skip
    fsdp_optim.save_checkpoint(model, optim, Path(work) / "saved-W8", extra={"step": 103})  # the re-cut floor's input
    reference = {"model": model.state_dict(), "optim": model.gather_full_optim_state_dict(optim)}
    if rank == 0:
        torch.save(reference, Path(work) / "reference.pt")
    dist.barrier()
    out = {"blocking_async_s": blocking_async, "blocking_memory_s": blocking_memory, "memory_save_total_s": total_memory}
    return {**out, "memory_bytes_node": manager.memory_bytes, "last_step": 100 + warmup + repeats - 1}


def _restore_job(rank: int, world_size: int, spec: models.ModelSpec, work: str, warmup: int, repeats: int) -> Any:
    import torch.distributed as dist

    import fsdp_optim

    model, optim, manager = _setup(rank, spec, work)  # state of the right shapes, other values
    memory, survived = Path(work) / "memory", Path(work) / "survived"

    def fresh_copy() -> None:
        if rank == 0:
            shutil.rmtree(memory, ignore_errors=True)
            shutil.copytree(survived, memory)

    fresh_copy()
    dist.barrier()
    manager.restore(model, optim)  # the state the floor's checkpoint holds
    local = Path(work) / "local"
    fsdp_optim.save_checkpoint(model, optim, local, overwrite=True)
    # Interleaved, so that the three see the same machine (2 shared cores: its load drifts within seconds).
    runs: dict[str, Any] = {
        "floor": (lambda: fsdp_optim.load_checkpoint(model, optim, local), None),
        "recut": (lambda: fsdp_optim.load_checkpoint(model, optim, Path(work) / "saved-W8"), None),
        "restore": (lambda: manager.restore(model, optim), fresh_copy),  # last: its state is checked below
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(warmup + repeats):
        for name, (fn, before) in runs.items():
            times[name].append(_median(lambda _: fn(), 0, 1, before=before))
    restore, floor, recut = (statistics.median(times[n][warmup:]) for n in ("restore", "floor", "recut"))
    loaded = {"model": model.state_dict(), "optim": model.gather_full_optim_state_dict(optim)}
    exact = None
    if rank == 0:
        reference = torch.load(Path(work) / "reference.pt", weights_only=False)
        exact = not difference(loaded["model"], reference["model"]) and not difference(
            {k: v for k, v in loaded["optim"].items() if k != "fsdp_optim"}, {k: v for k, v in reference["optim"].items() if k != "fsdp_optim"}
        )
    dist.barrier()
    return {"restore_memory_s": restore, "load_local_s": floor, "load_recut_s": recut, "exact": exact, "restored_step": manager.restored_step,
            "restored_from": manager.restored_from}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory_tier", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_MODEL} model, into benchmarks/out/")
    p.add_argument("--model", help=f"a preset {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {MODEL})")
    p.add_argument("--repeats", type=int, default=REPEATS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    spec = models.parse_model(args.model or (QUICK_MODEL if args.quick else MODEL))
    out = SCRATCH if args.quick else RESULTS
    saved_w, restored_w = SAVED_NODES * RANKS_PER_NODE, (SAVED_NODES - 1) * RANKS_PER_NODE
    work = Path(tempfile.mkdtemp(prefix="fsdp_optim-bench-memtier-", dir=STORAGE if STORAGE.is_dir() else None))
    load_before = os.getloadavg()[0]
    try:
        saved = spawn.run_ranks(_save_job, saved_w, spec, str(work), WARMUP, args.repeats)[0]
        shutil.rmtree(work / "memory" / f"node-{SAVED_NODES - 1}")  # lose the last node
        shutil.copytree(work / "memory", work / "survived")
        restored = spawn.run_ranks(_restore_job, restored_w, spec, str(work), WARMUP, args.repeats)[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    row = {"model": spec.name, "params": spec.numel, "saved_world_size": saved_w, "restored_world_size": restored_w,
           **saved, **restored, "load_average": [load_before, os.getloadavg()[0]]}  # fmt: skip
    row["blocking_ratio"] = row["blocking_memory_s"] / row["blocking_async_s"]
    row["restore_ratio"] = row["restore_memory_s"] / row["load_local_s"]
    row["steps_lost"] = row["last_step"] - row["restored_step"]
    out.mkdir(parents=True, exist_ok=True)
    name = "memory_tier_quick" if args.quick else "memory_tier"
    (out / f"{name}.json").write_text(json.dumps(row, indent=1))
    (out / f"{name}.md").write_text(_report(row, " ".join(["python -m benchmarks.memory_tier", *(argv or sys.argv[1:])])))
    print((out / f"{name}.md").read_text())
    return 0


def _report(r: dict[str, Any], command: str) -> str:
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    return f"""# Memory tier: save blocking part and restore after losing a node

Command: `{command}` (median of {REPEATS} after {WARMUP} warm-up; the restore and both loads interleaved, repeat by
repeat; 2-core CPU machine shared with other work, 1-minute load average {r['load_average'][0]:.1f} before the run and
{r['load_average'][1]:.1f} after; gloo, every rank a process, "nodes" are groups of 2 processes with their own
directory under /dev/shm). Model {r['model']}
({r['params'] / 1e6:.1f}M params, Adam). Saved at W={r['saved_world_size']} (4 nodes x 2), node 3 lost, restored at
W={r['restored_world_size']} (3 nodes x 2).

| measure | value | target |
|---|---|---|
| memory-tier save, blocking part (W={r['saved_world_size']}) | {ms(r['blocking_memory_s'])} | <= async save's |
| async_save_checkpoint, blocking part | {ms(r['blocking_async_s'])} | |
| ratio | {r['blocking_ratio']:.2f}x | <= 1.00x |
| memory-tier save, total (write + replicate + mark) | {ms(r['memory_save_total_s'])} | |
| memory held by one node (2 steps kept) | {r['memory_bytes_node'] / 2**20:.1f} MiB | bounded |
| restore from memory after losing a node (W=8 -> 6) | {ms(r['restore_memory_s'])} | |
| load_checkpoint at W=6 from local page cache (floor) | {ms(r['load_local_s'])} | |
| ratio | {r['restore_ratio']:.2f}x | <= 1.20x |
| load_checkpoint at W=6 of the W=8 checkpoint in page cache (re-cut, no transfer) | {ms(r['load_recut_s'])} | |
| restore / re-cut load | {r['restore_memory_s'] / r['load_recut_s']:.2f}x | |
| restored from / step | {r['restored_from']} / {r['restored_step']} | newest memory step |
| steps lost | {r['steps_lost']} | <= memory interval (1 here) |
| bit-identical to the saved state | {r['exact']} | True |
"""


if __name__ == "__main__":
    raise SystemExit(main())
