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
from .timed import SHM, best, make_source, planned_reads, sample


def _here(gib: float, repeats: int) -> dict[str, Any]:
    """Every round runs each verb by one process and then by two, so a load that comes and goes meets both alike."""
    with tempfile.TemporaryDirectory(dir=SHM, prefix="offline_parallel_") as scratch:
        src = Path(scratch) / "src"
        size = make_source(src, gib)
        print(f"source: {size} bytes on tmpfs", flush=True)
        verbs = {"runs": (["reshard", str(src), "--world-size", "3"], "out"),
                 "consolidate": (["consolidate", str(src)], "model.safetensors")}  # fmt: skip
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {(v, p): [] for v in verbs for p in (1, 2)}
        load = {"before": list(os.getloadavg())}
        for round_ in range(repeats):
            for (verb, processes), done in samples.items():
                done.append(sample(src, processes, *verbs[verb]))
                print(json.dumps({"round": round_, "what": verb} | done[-1]), flush=True)
            load[f"after round {round_ + 1}"] = list(os.getloadavg())
        result = {v: [best(samples[v, p]) for p in (1, 2)] for v in verbs}
        for run, processes in zip(result["runs"], (1, 2)):
            run["bytes_read"] = planned_reads(src, 3, processes)
        return {"gib": gib, "input_bytes": size, **result, "loadavg": load}


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
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each verb by 1 and then 2 processes (the best is kept)")
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
