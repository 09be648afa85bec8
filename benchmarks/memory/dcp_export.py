"""Export to PyTorch DCP (``python -m benchmarks.memory dcp_export``): files written, time and peak memory of ``to_dcp``.

A synthetic Adam state (``LAYERS`` x ``DIM``^2 fp32, 768 MiB, largest tensor 16 MiB), resharded into our sharded
checkpoint at W=2, is the source. Each row runs in a fresh interpreter, rows rotated over the rounds: ``to_dcp``
(ours: one data file); the ``per-tensor writer`` it replaced (the same lazy planner through DCP's
``FileSystemWriter``, a file per item); ``torch one-file writer`` (the same, one file per rank: it keeps every
tensor of a file until it closes it); ``read only (floor)`` (every tensor made and dropped, nothing written); and
``dcp.save`` of the state already in memory. Targets: growth <= largest tensor + 64 MiB (the source's mapping
bound), <= the reading floor's + 8 MiB, time <= the per-tensor writer's, 2 files.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import warnings
from pathlib import Path
from typing import Any

from ..peak import MiB, adam_full_dict, fresh, layers, measured

LAYERS, DIM = 24, 2048
OPS = ["to_dcp (ours)", "per-tensor writer", "torch one-file writer", "dcp.save (peer)", "read only (floor)"]
SLACK = 64 * MiB  # the source reader's mapping bound (DEFAULT_MAPPED_BYTES)


def make(work: Path, count: int, dim: int = DIM) -> dict[str, Any]:
    """``full.pt`` (our full dict) and ``ckpt/`` (it resharded for 2 ranks, one flattened unit per layer); the dict."""
    import torch

    import fsdp_optim
    from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec

    shapes = layers(count, dim)
    full = adam_full_dict(shapes, 2, eps=1e-8, weight_decay=0.0)
    torch.save(full, work / "full.pt")
    flats = tuple(FlatParamLayout(n.removesuffix(".weight"), (ParamSpec(n, (dim, dim), 0),), 2, 0, torch.float32, True) for n in shapes)
    fsdp_optim.reshard(full, 2, work / "ckpt", layout=ModelLayout(flats, tuple(shapes), 2, 0))
    return full


def _optim_dict(source: Path, opened: Any) -> tuple[dict[int, Any], dict[str, Any]]:
    from fsdp_optim.formats.dcp import optim_dict

    producers: dict[int, Any] = {}
    assert opened.source is not None, f"{source}: holds no optimizer state"
    return producers, {"optim": optim_dict(opened.source, opened.order, producers, opened.trim, None)}


def _torch_writer(source: Path, out: Path, *, one_file: bool) -> None:
    """``to_dcp`` of a source holding optimizer state only, written through DCP's own ``FileSystemWriter``."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.checkpoint import FileSystemWriter

    from fsdp_optim.disk.local_directory import staged_output
    from fsdp_optim.formats.dcp import DCP_DIRECTORY, METADATA, _LazyPlanner
    from fsdp_optim.offline.sources import open_source

    with open_source(source) as opened:
        producers, state = _optim_dict(source, opened)
        with staged_output(out, DCP_DIRECTORY, purpose="benchmark", inputs=(source,)) as stage:
            stage.last = (METADATA,)
            writer = FileSystemWriter(stage.dir, single_file_per_rank=one_file, thread_count=1, sync_files=True)
            dist_cp.save(state, storage_writer=writer, planner=_LazyPlanner(producers), no_dist=True)


def _read_only(source: Path) -> None:
    from fsdp_optim.offline.sources import open_source

    with open_source(source) as opened:
        for make_tensor in _optim_dict(source, opened)[0].values():
            make_tensor()


def measure(op: str, work: str, count: str = "") -> dict[str, Any]:
    """One row (or ``make``: the sources, in a process of its own: it holds the whole dict), in a fresh interpreter."""
    if op == "make":
        make(Path(work), int(count))
        return {"op": op}
    import torch
    import torch.distributed.checkpoint as dist_cp

    import fsdp_optim

    # every module a row uses is imported before the measured window (fsdp_optim imports its names lazily)
    for module in ("fsdp_optim.offline.export", "fsdp_optim.offline.sources", "fsdp_optim.disk.local_directory"):
        importlib.import_module(module)
    w = Path(work)
    out = w / "out"
    shutil.rmtree(out, ignore_errors=True)
    named = {"optim": fsdp_optim.to_named(torch.load(w / "full.pt", weights_only=True))} if op == "dcp.save (peer)" else None
    operations = {
        "to_dcp (ours)": lambda: fsdp_optim.to_dcp(w / "ckpt", out),
        "per-tensor writer": lambda: _torch_writer(w / "ckpt", out, one_file=False),
        "torch one-file writer": lambda: _torch_writer(w / "ckpt", out, one_file=True),
        "dcp.save (peer)": lambda: dist_cp.save(named, checkpoint_id=out, no_dist=True),
        "read only (floor)": lambda: _read_only(w / "ckpt"),
    }
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    seconds, growth, _ = measured(operations[op])
    files = sorted(os.listdir(out)) if out.exists() else []
    return {"op": op, "seconds": seconds, "peak_growth": growth, "files": len(files), "bytes": sum((out / n).stat().st_size for n in files)}


def _summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rows = {}
    for op in OPS:
        mine = [r for r in runs if r["op"] == op]
        seconds, growth = [r["seconds"] for r in mine], [r["peak_growth"] for r in mine]
        rows[op] = {"seconds": statistics.median(seconds), "all_seconds": seconds, "peak_growth": max(growth), "median_growth": statistics.median(growth),
                    "all_growth": growth, "files": mine[-1]["files"], "bytes": mine[-1]["bytes"]}  # fmt: skip
    return rows


def _print(rows: dict[str, dict[str, Any]], count: int, largest: int, state_bytes: int) -> dict[str, bool]:
    base, peer, ours = rows["per-tensor writer"], rows["dcp.save (peer)"], rows["to_dcp (ours)"]
    print(f"state: {count} params of {DIM}x{DIM} fp32, Adam: {state_bytes / MiB:,.0f} MiB of tensors, largest tensor {largest / MiB:,.0f} MiB; "
          "source: our sharded checkpoint at W=2")  # fmt: skip
    print(f"{'row':<24} {'files':>6} {'MiB':>6} {'seconds':>8} {'x per-tensor':>13} {'x dcp.save':>11} {'peak RSS growth MiB: median':>28} {'max':>5} {'/ largest':>10}")
    for op, r in rows.items():
        print(f"{op:<24} {r['files']:>6} {r['bytes'] / MiB:>6,.0f} {r['seconds']:>8.2f} {r['seconds'] / base['seconds']:>13.2f} {r['seconds'] / peer['seconds']:>11.2f} "
              f"{r['median_growth'] / MiB:>28,.0f} {r['peak_growth'] / MiB:>5,.0f} {r['median_growth'] / largest:>10.2f}")  # fmt: skip
    targets = {
        "memory: max growth <= largest tensor + 64 MiB": ours["peak_growth"] <= largest + SLACK,
        "memory: median growth <= read-only floor's + 8 MiB": ours["median_growth"] <= rows["read only (floor)"]["median_growth"] + 8 * MiB,
        "time: <= per-tensor writer": ours["seconds"] <= base["seconds"],
        "files: 1 data file + .metadata": ours["files"] == 2,
    }
    for name, met in targets.items():
        print(f"  {'met   ' if met else 'MISSED'} {name}")
    return targets


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    count, repeat = args.layers or (2 if args.small else LAYERS), args.repeat or (1 if args.small else 3)
    if not (work / "ckpt").exists():
        fresh("benchmarks.memory", "dcp_export", "make", work, count)
    runs = [fresh("benchmarks.memory", "dcp_export", OPS[(i + r) % len(OPS)], work) for r in range(repeat) for i in range(len(OPS))]  # the order rotates
    largest = DIM * DIM * 4
    state_bytes = count * (2 * largest + 4)
    rows = _summarize(runs)
    targets = _print(rows, count, largest, state_bytes)
    return {"layers": count, "dim": DIM, "state_bytes": state_bytes, "largest_tensor": largest, "repeat": repeat, "rows": rows, "targets": targets}
