"""Benchmark: gathering sharded Adam state into one full dict, per world size, against peers and floors.

    python -m benchmarks.gather            # full run: 25M and 100M models, W = 1, 2, 3, 4, 8 (~25 min on 2 cores)
    python -m benchmarks.gather --quick    # smoke run: 5M model, W = 1, 2, 4 (~1 min), into benchmarks/out/

For every (model, world size) it spawns fresh ranks (gloo on CPU, NCCL when CUDA is present), trains the
model a few Adam steps under each framework, then times every method (see ``peers`` and ``floors``) and
writes ``<out>/<name>.md``, ``.json`` and ``.png``. Ratios are to the fresh-memory point-to-point floor.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import models, report, spawn, suite

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
RESULTS_DIR = Path(__file__).parent / "results"  # committed: the latest full run
SCRATCH_DIR = Path(__file__).parent / "out"  # git-ignored: quick and ad-hoc runs
COLLECTIVE_TIMEOUT_S = 600
# -----------------------------------------------------------------------------------------------------


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gather", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 5M model, W = 1, 2, 4; writes to benchmarks/out/")
    p.add_argument(
        "--models", type=_csv, help=f"presets {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {','.join(MODELS)})"
    )
    p.add_argument("--world-sizes", type=lambda s: tuple(int(x) for x in _csv(s)), help="default 1,2,3,4,8")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per method (median reported)")
    p.add_argument("--steps", type=int, default=TRAIN_STEPS, help="Adam training steps before gathering")
    p.add_argument("--methods", type=_csv, default=METHODS, help=f"subset of {','.join(METHODS)}")
    p.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl when CUDA is available"
    )
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results, --quick: benchmarks/out)")
    p.add_argument("--name", help="output file stem (default latest, --quick: quick)")
    args = p.parse_args(argv)
    args.models = args.models or (QUICK["models"] if args.quick else MODELS)
    args.world_sizes = args.world_sizes or (QUICK["world_sizes"] if args.quick else WORLD_SIZES)
    args.out = args.out or (SCRATCH_DIR if args.quick else RESULTS_DIR)
    args.name = args.name or ("quick" if args.quick else "latest")
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; expected a subset of {list(METHODS)}")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    return args


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        memory = f", {kib / (1 << 20):.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    gpu = f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {os.cpu_count()} cores{memory}{gpu}, {platform.system()} {platform.release()}"


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import fairscale

    specs = [models.parse_model(m) for m in args.models]
    sizes = list(args.world_sizes)
    if args.backend == "nccl":
        too_big = [w for w in sizes if w > torch.cuda.device_count()]
        if too_big:
            print(f"skipping world sizes {too_big}: NCCL needs one GPU per rank, {torch.cuda.device_count()} present")
        sizes = [w for w in sizes if w <= torch.cuda.device_count()]
    meta: dict[str, Any] = {
        "command": ("python -m benchmarks.gather " + shlex.join(sys.argv[1:] if argv is None else argv)).strip(),
        "machine": machine(),
        "cores": os.cpu_count(),
        "oversubscribed": any(w > (os.cpu_count() or 1) for w in sizes),
        "backend": args.backend,
        "versions": f"torch {torch.__version__}, fairscale {fairscale.__version__}, Python {platform.python_version()}",
        "warmup": args.warmup,
        "repeats": args.repeats,
        "steps": args.steps,
        "models": {s.name: s.numel for s in specs},
        "load_before": _load(),
        "runs": [],
    }
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for world_size in sizes:
        cfgs = [
            suite.RunConfig(
                model=spec,
                steps=args.steps,
                warmup=args.warmup,
                repeats=args.repeats,
                methods=tuple(args.methods),
                device_type="cuda" if args.backend == "nccl" else "cpu",
            )
            for spec in specs
        ]
        t0 = time.perf_counter()
        names = ", ".join(f"{s.name} ({s.numel / 1e6:.1f}M params)" for s in specs)
        print(f"[{t0 - started:6.0f}s] W={world_size}: {names} ...", flush=True)
        payloads = spawn.run_ranks(
            suite.run_all, world_size, cfgs, backend=args.backend, collective_timeout_s=COLLECTIVE_TIMEOUT_S
        )[0]
        for spec, payload in zip(specs, payloads):
            new_rows = report.rows_of(spec.name, world_size, payload)
            rows += new_rows
            meta["runs"].append({"model": spec.name, "world_size": world_size, **payload["timings"]})
            print(report.console(new_rows), flush=True)
        meta["runs"].append({"world_size": world_size, "wall_s": time.perf_counter() - t0})
    meta["wall_s"] = time.perf_counter() - started
    meta["load_after"] = _load()
    meta["finished"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    paths = report.write(rows, meta, args.out, args.name)
    print()
    print(report.console(rows))
    print()
    for verdict in report.targets(rows):
        print(
            f"{'MET ' if verdict['met'] else 'MISS'} {verdict['target']:<42} {verdict['model']:>5} W={verdict['world_size']} "
            f"value {verdict['value']:.2f} ({verdict['detail']})"
        )
    print(f"\nwall time {meta['wall_s'] / 60:.1f} min; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
