"""Benchmark: sharded optimizer checkpoints (save, async save, load at the same and another world size,
offline consolidate and reshard, training throughput), ours against PyTorch DCP + FSDP2 and the floors.

For each model, world sizes run one after another in fresh gloo jobs (``job.py``'s ``run_optim``, through ``spawn.jobs``); a job loads the
checkpoints a job of another world size saved: W < max loads those of max W (saved first by a short
job that only trains and saves), max W loads those of the next smaller W. Checkpoints live under a
temporary directory on tmpfs (``/dev/shm``; ``--dir`` to choose), the references for the checks under
the system's temporary directory; both are removed at the end. Writes ``<out>/<name>.md``, ``.json``
and ``.png``; ratios are to the floor of the same operation (``ckpt/floors.py``) and to DCP's counterpart.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from . import job, models, spawn
from .ckpt import report as ckpt_report
from .ckpt.train import TrainConfig
from .host import storage
from .report import Run
from .spawn import csv

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
    spawn.options(p, warmup=WARMUP, repeats=REPEATS, steps=TRAIN_STEPS, storage=STORAGE, name="checkpoint_latest")
    p.add_argument("--models", type=csv, help=f"presets {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {','.join(MODELS)})")
    p.add_argument("--train-every", type=int, help=f"training runs: steps between checkpoints (default {TRAIN.every})")
    p.add_argument("--train-repeats", type=int, help=f"training runs per variant (default {TRAIN.repeats}); 0: skip")
    args = p.parse_args(argv)
    args.models = args.models or (QUICK["models"] if args.quick else MODELS)
    sizes: tuple[int, ...] = QUICK["world_sizes"] if args.quick else WORLD_SIZES  # type: ignore[assignment]
    spawn.resolve(args, world_sizes=sizes, repeats=REPEATS, quick_repeats=QUICK["repeats"], storage=STORAGE, name="checkpoint_latest", quick_name="checkpoint_quick")  # type: ignore[arg-type]
    base: TrainConfig = QUICK["train"] if args.quick else TRAIN  # type: ignore[assignment]
    repeats = base.repeats if args.train_repeats is None else args.train_repeats
    args.train = TrainConfig(args.train_every or base.every, base.checkpoints, repeats) if repeats > 0 else None
    if args.repeats < 1 or args.warmup < 0 or min(args.world_sizes) < 1:
        p.error("--repeats must be >= 1, --warmup >= 0, world sizes >= 1")
    return args


def run_model(args: argparse.Namespace, spec: models.ModelSpec, root: Path, refs: Path, log: Any) -> list[dict[str, Any]]:
    sizes, other = args.world_sizes, spawn.plan(args.world_sizes)

    def cfg(world_size: int, source_only: bool) -> job.JobConfig:
        skipped = (spec.name, world_size) in TRAIN_SKIP
        return job.JobConfig(
            model=spec, steps=args.steps, warmup=args.warmup, repeats=args.repeats, work=str(root / f"work-W{world_size}"), refs=str(refs),
            publish_ref=world_size in other.values(), other=other[world_size], train=None if skipped else args.train, source_only=source_only,
            skip_train="skipped for time (TRAIN_SKIP in benchmarks/checkpoint.py)" if skipped and args.train else "",
        )  # fmt: skip

    def after(world_size: int, payload: Any, needed: set[int | None]) -> None:
        shutil.rmtree(root / f"work-W{world_size}", ignore_errors=True)
        for w in (w for w in sizes if w not in needed):
            for path in (root / f"ours-W{w}", root / f"dcp-W{w}", refs / f"ref-ours-W{w}.pt", refs / f"ref-dcp-W{w}.pt"):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    return spawn.jobs(sizes, spec, job.run_optim, cfg, ckpt_report, log, after=after, timeout_s=COLLECTIVE_TIMEOUT_S)[0]


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
    rows: list[dict[str, Any]] = []
    with spawn.scratch("fsdp_optim_ckpt_", args.dir) as (root, refs):
        for spec in specs:
            rows += run_model(args, spec, root, refs, run.log)
    run.close(ckpt_report, rows, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
