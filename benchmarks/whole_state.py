"""Benchmark: whole-state checkpoints (weights + buffers + optimizer state), ``save_checkpoint`` / ``load_checkpoint``
against the per-rank torch.save / torch.load floor, PyTorch DCP + FSDP2 and fairscale's full state dicts.

World sizes run one after another in fresh gloo jobs (``job.py``'s ``run_whole``, through ``spawn.jobs``), every rank a spawned
process; each job loads the checkpoint a job of another world size saved (W < max loads max W's, saved first by a short
job that only trains and saves; max W loads the next smaller W's) into the model at another FSDP nesting. Checkpoints
live under a temporary directory on tmpfs (``/dev/shm``; ``--dir`` to choose), the references for the checks under
the system's temporary directory; both are removed at the end. Writes ``<out>/<name>.md`` and ``.json``; ratios are
to the floor of the same operation and to DCP's counterpart, in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from . import job, models, spawn
from .host import storage
from .report import Run
from .whole import offline as whole_offline
from .whole import report as whole_report

# ---- configuration ---------------------------------------------------------------------------------
MODEL = "100M"
WORLD_SIZES = (2, 4)
WARMUP = 1
REPEATS = 3
PEER_REPEATS = 1  # fairscale's full state dict save and load: slow, measured for their peak RSS
STEPS = 1  # Adam steps before the first save
QUICK = {"model": "5M", "repeats": 3}
STORAGE = Path("/dev/shm")  # tmpfs: the time is the code's, not the disk's; --dir to measure a disk
COLLECTIVE_TIMEOUT_S = 900
# -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.whole_state", description=__doc__.split("\n")[0])
    spawn.options(p, warmup=WARMUP, repeats=REPEATS, steps=STEPS, storage=STORAGE, name="whole_state")
    p.add_argument("--model", help=f"a preset {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {MODEL})")
    p.add_argument("--peer-repeats", type=int, default=PEER_REPEATS, help="calls of fairscale's full state dict save/load")
    args = spawn.resolve(p.parse_args(argv), world_sizes=WORLD_SIZES, repeats=REPEATS, quick_repeats=QUICK["repeats"], storage=STORAGE, name="whole_state")  # type: ignore[arg-type]
    args.model = args.model or (QUICK["model"] if args.quick else MODEL)
    if args.repeats < 1 or args.warmup < 0 or args.peer_repeats < 1 or min(args.world_sizes) < 2:
        p.error("--repeats and --peer-repeats must be >= 1, --warmup >= 0, world sizes >= 2 (W=1 is not sharded)")
    return args


def run_jobs(args: argparse.Namespace, spec: models.ModelSpec, root: Path, refs: Path, log: Any) -> tuple[list[dict[str, Any]], dict[int, str]]:
    other = spawn.plan(args.world_sizes)

    def cfg(world_size: int, source_only: bool) -> job.JobConfig:
        return job.JobConfig(
            model=spec, steps=args.steps, warmup=args.warmup, repeats=args.repeats, peer_repeats=args.peer_repeats,
            work=str(root / f"work-W{world_size}"), refs=str(refs), publish_ref=world_size in other.values(),
            other=other[world_size], source_only=source_only,
        )  # fmt: skip

    def after(world_size: int, payload: Any, needed: set[int | None]) -> None:
        work = root / f"work-W{world_size}"
        payload["results"] |= whole_offline.measure(root / f"whole-W{world_size}", work / "dcp", work, repeats=args.repeats)
        shutil.rmtree(work, ignore_errors=True)
        for w in (w for w in args.world_sizes if w not in needed):
            shutil.rmtree(root / f"whole-W{w}", ignore_errors=True)
            (refs / f"ref-W{w}.pt").unlink(missing_ok=True)

    return spawn.jobs(args.world_sizes, spec, job.run_whole, cfg, whole_report, log, after=after, timeout_s=COLLECTIVE_TIMEOUT_S, deadline_s=3600)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    spec = models.parse_model(args.model)
    run = Run("python -m benchmarks.whole_state", argv)
    run.meta |= {"model": spec.name, "numel": spec.numel, "world_sizes": list(args.world_sizes), "warmup": args.warmup, "repeats": args.repeats}
    run.meta |= {"peer_repeats": args.peer_repeats, "steps": args.steps, "storage": storage(args.dir)}
    with spawn.scratch("fsdp_optim_whole_", args.dir) as (root, refs):
        rows, loads = run_jobs(args, spec, root, refs, run.log)
    run.meta["job_loads"] = "; ".join(f"W={w}: {load}" for w, load in loads.items())
    run.close(whole_report, rows, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
