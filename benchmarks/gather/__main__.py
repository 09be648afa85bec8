"""Benchmark: gathering sharded Adam state into one full dict, per world size, against peers and floors.

For every (model, world size) it spawns fresh ranks (gloo on CPU, NCCL when CUDA is present), trains the
model a few Adam steps under each framework, then times every method (see ``peers`` and ``floors``) and
writes ``<out>/<name>.md``, ``.json`` and ``.png``. Ratios are to the fresh-memory point-to-point floor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .. import models, spawn
from ..registry import RESULTS, SCRATCH
from ..report import Run
from ..spawn import csv, ints
from . import report, suite

# ---- configuration ---------------------------------------------------------------------------------
MODELS = ("25M", "100M")
WORLD_SIZES = (1, 2, 3, 4, 8)
WARMUP = 1
REPEATS = 5
TRAIN_STEPS = 2
METHODS = (
    "floor_gather",
    "floor_p2p_warm",
    "floor_p2p_fresh",
    "ours",
    "ours_object",
    "get_shard",
    "floor_copy",
    "fairscale",
    "fsdp1",
    "fsdp2",
)
QUICK = {"models": ("5M",), "world_sizes": (1, 2, 4)}
COLLECTIVE_TIMEOUT_S = 600
# -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gather", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 5M model, W = 1, 2, 4; writes to benchmarks/out/")
    p.add_argument(
        "--models", type=csv, help=f"presets {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {','.join(MODELS)})"
    )
    p.add_argument("--world-sizes", type=ints, help="default 1,2,3,4,8")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per method (median reported)")
    p.add_argument("--steps", type=int, default=TRAIN_STEPS, help="Adam training steps before gathering")
    p.add_argument("--methods", type=csv, default=METHODS, help=f"subset of {','.join(METHODS)}")
    p.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl when CUDA is available"
    )
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results, --quick: benchmarks/out)")
    p.add_argument("--name", help="output file stem (default latest, --quick: quick)")
    args = p.parse_args(argv)
    args.models = args.models or (QUICK["models"] if args.quick else MODELS)
    args.world_sizes = args.world_sizes or (QUICK["world_sizes"] if args.quick else WORLD_SIZES)
    args.out = args.out or (SCRATCH if args.quick else RESULTS)
    args.name = args.name or ("quick" if args.quick else "latest")
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; expected a subset of {list(METHODS)}")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    specs = [models.parse_model(m) for m in args.models]
    sizes = list(args.world_sizes)
    if args.backend == "nccl":
        too_big = [w for w in sizes if w > torch.cuda.device_count()]
        if too_big:
            print(f"skipping world sizes {too_big}: NCCL needs one GPU per rank, {torch.cuda.device_count()} present")
        sizes = [w for w in sizes if w <= torch.cuda.device_count()]
    run = Run("python -m benchmarks.gather", argv, backend=args.backend)
    meta = run.meta | {"oversubscribed": any(w > (os.cpu_count() or 1) for w in sizes), "warmup": args.warmup, "repeats": args.repeats}
    meta |= {"steps": args.steps, "models": {s.name: s.numel for s in specs}, "runs": []}
    run.meta = meta
    rows: list[dict[str, Any]] = []
    device = "cuda" if args.backend == "nccl" else "cpu"
    for world_size in sizes:
        cfgs = [suite.RunConfig(model=spec, steps=args.steps, warmup=args.warmup, repeats=args.repeats, methods=tuple(args.methods), device_type=device) for spec in specs]
        t0 = time.perf_counter()
        run.log(f"W={world_size}: " + ", ".join(f"{s.name} ({s.numel / 1e6:.1f}M params)" for s in specs) + " ...")
        payloads = spawn.run_ranks(suite.run_all, world_size, cfgs, backend=args.backend, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]
        for spec, payload in zip(specs, payloads):
            new_rows = report.rows_of(spec.name, world_size, payload)
            rows += new_rows
            meta["runs"].append({"model": spec.name, "world_size": world_size, **payload["timings"]})
            print(report.console(new_rows), flush=True)
        meta["runs"].append({"world_size": world_size, "wall_s": time.perf_counter() - t0})
    run.close(report, rows, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
