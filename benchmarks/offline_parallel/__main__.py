"""``python -m benchmarks.offline_parallel [--gib 4] [--repeats 2] [--no-run] [--out DIR]``: see the package
docstring. Writes ``offline_parallel.{json,md}`` into ``--out`` (``benchmarks/results`` by default).

``python -m benchmarks.offline_parallel --size-gib 16 --on-disk --scratch DIR``: the one-process run on disk
(:mod:`.on_disk`) alone, into ``offline_<size>g.{json,md}``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..registry import RESULTS
from . import on_disk, render_disk
from .render import markdown, targets
from .simulate import cases
from .timed import SHM, make_source, planned_reads, timed


def _here(gib: float, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=SHM, prefix="offline_parallel_") as scratch:
        src = Path(scratch) / "src"
        size = make_source(src, gib)
        print(f"source: {size} bytes on tmpfs", flush=True)
        runs = []
        load = {"before": list(os.getloadavg())}
        for processes in (1, 2):
            reshard = ["reshard", str(src), "--world-size", "3"]
            run = timed(src, processes, reshard, "out", repeats) | {"bytes_read": planned_reads(src, 3, processes)}
            print(json.dumps(run), flush=True)
            runs.append(run)
            load[f"after {processes} process{'es' if processes > 1 else ''}"] = list(os.getloadavg())
        consolidated = []
        for processes in (1, 2):
            run = timed(src, processes, ["consolidate", str(src)], "model.safetensors", repeats)
            print(json.dumps(run), flush=True)
            consolidated.append(run)
            load[f"after consolidate, {processes} process{'es' if processes > 1 else ''}"] = list(os.getloadavg())
        return {"gib": gib, "input_bytes": size, "runs": runs, "consolidate": consolidated, "loadavg": load}


def _on_disk(args: argparse.Namespace, argv: list[str] | None) -> int:
    here = on_disk.run(args.gib, args.scratch, keep=args.keep_source)
    result: dict[str, Any] = {"meta": on_disk.meta(argv, args.scratch), "here": here, "notes": list(on_disk.NOTES)}
    result["targets"] = render_disk.targets(result)
    name = f"offline_{args.gib:g}g"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{name}.md").write_text(render_disk.markdown(result))
    print(render_disk.markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline_parallel")
    parser.add_argument("--gib", "--size-gib", type=float, default=4.0, help="the checkpoint's size here (the target asks >= 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per launcher (the best is kept)")
    parser.add_argument("--no-run", action="store_true", help="the simulation only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--on-disk", action="store_true", help="one process on disk instead (see on_disk.py)")
    parser.add_argument("--scratch", type=Path, help="with --on-disk: a directory on the disk to measure (required)")
    parser.add_argument("--keep-source", action="store_true", help="with --on-disk: keep SCRATCH/src for a rerun")
    args = parser.parse_args(argv)
    if args.on_disk:
        if args.scratch is None:
            parser.error("--on-disk needs --scratch DIR, a directory on the disk to measure")
        return _on_disk(args, argv)
    simulated = cases()
    for row in simulated:
        print(json.dumps(row), flush=True)
    here = None if args.no_run else _here(args.gib, args.repeats)
    command = "python -m benchmarks.offline_parallel " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"meta": {"command": command.strip()}, "here": here, "simulated": simulated}
    result["targets"] = targets(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_parallel.json").write_text(json.dumps(result, indent=1))
    (args.out / "offline_parallel.md").write_text(markdown(result))
    print(markdown(result))
    shutil.rmtree(SHM / "offline_parallel_none", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
