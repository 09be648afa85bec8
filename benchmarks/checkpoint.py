"""Benchmark: sharded optimizer checkpoints (save, async save, load at the same and another world size,
offline consolidate and reshard, training throughput), ours against PyTorch DCP + FSDP2 and the floors.

    python -m benchmarks.checkpoint            # full run: 25M and 100M models, W = 1, 2, 4 (~25 min on 2 cores)
    python -m benchmarks.checkpoint --quick    # smoke run: 5M model, W = 1, 2 (~2 min), into benchmarks/out/

For each model, world sizes run one after another in fresh gloo jobs (``ckpt_job.run``); a job loads the
checkpoints a job of another world size saved: W < max loads those of max W (saved first by a short
job that only trains and saves), max W loads those of the next smaller W. Checkpoints live under a
temporary directory on tmpfs (``/dev/shm``; ``--dir`` to choose), the references for the checks under
the system's temporary directory; both are removed at the end. Writes ``<out>/<name>.md``, ``.json``
and ``.png``; ratios are to the floor of the same operation (``ckpt_floors``) and to DCP's counterpart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import models, spawn
from .ckpt import job as ckpt_job
from .ckpt import report as ckpt_report
from .ckpt.train import TrainConfig
from .report import RESULTS, SCRATCH, Run, csv, ints, storage, verdict_lines

# ---- configuration ---------------------------------------------------------------------------------
MODELS = ("25M", "100M")
WORLD_SIZES = (1, 2, 4)
WARMUP = 1
REPEATS = 4
TRAIN_STEPS = 2  # Adam steps before the first save
TRAIN = TrainConfig(every=2, checkpoints=2, repeats=3)  # runs of 6 steps, a checkpoint after steps 2 and 4
# (model, W) whose training runs are skipped for time: ~5 s per step (2x oversubscribed), ~8 min alone.
TRAIN_SKIP = {("100M", 4)}
QUICK = {"models": ("5M",), "world_sizes": (1, 2), "repeats": 3, "train": TrainConfig(every=2, checkpoints=2, repeats=2)}
STORAGE = Path("/dev/shm")  # tmpfs: the time is the code's, not the disk's; --dir to measure a disk
COLLECTIVE_TIMEOUT_S = 900
# -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 5M model, W = 1, 2; writes to benchmarks/out/")
    p.add_argument("--models", type=csv, help=f"presets {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {','.join(MODELS)})")
    p.add_argument("--world-sizes", type=ints, help="default 1,2,4")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--repeats", type=int, help=f"timed calls per method (median reported; default {REPEATS})")
    p.add_argument("--steps", type=int, default=TRAIN_STEPS, help="Adam training steps before saving")
    p.add_argument("--train-every", type=int, help=f"training runs: steps between checkpoints (default {TRAIN.every})")
    p.add_argument("--train-repeats", type=int, help=f"training runs per variant (default {TRAIN.repeats}); 0: skip")
    p.add_argument("--dir", type=Path, help=f"where checkpoints are written (default {STORAGE} if present)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results, --quick: benchmarks/out)")
    p.add_argument("--name", help="output file stem (default checkpoint_latest, --quick: checkpoint_quick)")
    args = p.parse_args(argv)
    args.models = args.models or (QUICK["models"] if args.quick else MODELS)
    args.world_sizes = tuple(sorted(set(args.world_sizes or (QUICK["world_sizes"] if args.quick else WORLD_SIZES))))
    args.repeats = args.repeats or (QUICK["repeats"] if args.quick else REPEATS)
    base: TrainConfig = QUICK["train"] if args.quick else TRAIN  # type: ignore[assignment]
    repeats = base.repeats if args.train_repeats is None else args.train_repeats
    args.train = TrainConfig(args.train_every or base.every, base.checkpoints, repeats) if repeats > 0 else None
    args.dir = args.dir or (STORAGE if STORAGE.is_dir() and os.access(STORAGE, os.W_OK) else Path(tempfile.gettempdir()))
    args.out = args.out or (SCRATCH if args.quick else RESULTS)
    args.name = args.name or ("checkpoint_quick" if args.quick else "checkpoint_latest")
    if args.repeats < 1 or args.warmup < 0 or min(args.world_sizes) < 1:
        p.error("--repeats must be >= 1, --warmup >= 0, world sizes >= 1")
    return args


def plan(sizes: tuple[int, ...]) -> dict[int, int | None]:
    """The other world size whose checkpoints each world size loads (and reshards to)."""
    if len(sizes) == 1:
        return {sizes[0]: None}
    return {w: (sizes[-1] if w != sizes[-1] else sizes[-2]) for w in sizes}


def _source(root: Path, refs: Path, world_size: int) -> ckpt_job.Source:
    return ckpt_job.Source(
        world_size,
        ours=str(root / f"ours-W{world_size}"),
        dcp=str(root / f"dcp-W{world_size}"),
        ref_ours=str(refs / f"ref-ours-W{world_size}.pt"),
        ref_dcp=str(refs / f"ref-dcp-W{world_size}.pt"),
    )


def _spawn(cfg: ckpt_job.JobConfig, world_size: int) -> Any:
    return spawn.run_ranks(ckpt_job.run, world_size, cfg, collective_timeout_s=COLLECTIVE_TIMEOUT_S)[0]


def run_model(args: argparse.Namespace, spec: models.ModelSpec, root: Path, refs: Path, log: Any) -> list[dict[str, Any]]:
    sizes, other = args.world_sizes, plan(args.world_sizes)
    sources = {w: _source(root, refs, w) for w in sizes}
    needed = set(o for o in other.values() if o is not None)

    def job(world_size: int, source_only: bool = False) -> ckpt_job.JobConfig:
        partner = other[world_size]
        skipped = (spec.name, world_size) in TRAIN_SKIP
        return ckpt_job.JobConfig(
            model=spec, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
            work=str(root / f"work-W{world_size}"), own=sources[world_size], publish_refs=world_size in needed,
            other=sources[partner] if partner is not None else None, reshard_to=partner,
            train=None if skipped else args.train, source_only=source_only,
            skip_train="skipped for time (TRAIN_SKIP in benchmarks/checkpoint.py)" if skipped and args.train else "",
        )

    rows: list[dict[str, Any]] = []
    if len(sizes) > 1:  # the smaller world sizes load the largest's checkpoints before its own job runs
        log(f"{spec.name} W={sizes[-1]}: saving the checkpoints the smaller world sizes load ...")
        _spawn(job(sizes[-1], source_only=True), sizes[-1])
    for k, world_size in enumerate(sizes):
        log(f"{spec.name} ({spec.numel / 1e6:.1f}M params) W={world_size} ...")
        t0 = time.perf_counter()
        payload = _spawn(job(world_size), world_size)
        new = ckpt_report.rows_of(spec.name, world_size, payload)
        rows += new
        log(f"{spec.name} W={world_size} done in {time.perf_counter() - t0:.0f} s {payload['timings']}")
        print(ckpt_report.console(new), flush=True)
        shutil.rmtree(root / f"work-W{world_size}", ignore_errors=True)
        later = {other[w] for w in sizes[k + 1 :]}
        for w, src in sources.items():
            if w not in later:
                for path in (src.ours, src.dcp, src.ref_ours, src.ref_dcp):
                    shutil.rmtree(path, ignore_errors=True) if Path(path).is_dir() else Path(path).unlink(missing_ok=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    specs = [models.parse_model(m) for m in args.models]
    run = Run("python -m benchmarks.checkpoint", argv)
    run.meta |= {
        "train_skipped": sorted(f"{m} W={w}" for m, w in TRAIN_SKIP if m in args.models and w in args.world_sizes),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "steps": args.steps,
        "train": None if args.train is None else {**vars(args.train), "steps": args.train.steps},
        "models": {s.name: s.numel for s in specs},
        "storage": storage(args.dir),
    }
    root = Path(tempfile.mkdtemp(prefix="fsdp_optim_ckpt_", dir=args.dir))
    refs = Path(tempfile.mkdtemp(prefix="fsdp_optim_ckpt_refs_"))
    rows: list[dict[str, Any]] = []
    try:
        for spec in specs:
            rows += run_model(args, spec, root, refs, run.log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(refs, ignore_errors=True)
    meta = run.finish()
    run.done(ckpt_report.write(rows, meta, args.out, args.name), ckpt_report.console(rows), verdict_lines(ckpt_report.targets(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
