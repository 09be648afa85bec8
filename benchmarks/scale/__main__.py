"""Benchmark: sharded checkpoints at scale (many ranks, many units), ours against the floors, in one run; the
commands, the floors and the latest figures are in docs/benchmarks.md ("At scale").

Four parts: offline ``reshard`` / ``consolidate`` / ``inspect`` of checkpoints of ``W x U`` (``--offline``), each in
a forked child (time, peak RSS growth; median of 3 under 2 s), against the byte and re-cut floors of ``ops.py``;
planning one rank of a ``W x U`` re-cut (``--plan``, ``ops.plan_one_rank``); jobs of ``--jobs`` world sizes
(``job.py``); ``reshard``'s first and second call in fresh interpreters against the byte floor (``--fresh``,
``fresh.py``). Writes ``<out>/<name>.json``, ``.md`` and ``.png`` (default ``benchmarks/results/scale``); the fixed
costs alone: ``--offline '' --plan '' --skip-jobs --name scale_fresh``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_optim import consolidate, reshard
from fsdp_optim.formats.sharded.manifest import Manifest

from .. import spawn
from ..host import machine, package
from ..peak import in_child, save_durably
from ..registry import RESULTS
from . import job as scale_job
from . import ops as scale_ops
from .fresh import fixed_costs
from .report import plot, tables

# ---- configuration ---------------------------------------------------------------------------------
OFFLINE = ((16, 64), (64, 64), (64, 256))  # (W, units)
PLAN = ((256, 100), (1024, 100), (4096, 100), (256, 1000), (1024, 1000), (4096, 1000))
FRESH = ((256, 256),)  # (W, units): issue 46's fixed costs, 256 -> 192 ranks (448 files)
JOBS = (16, 8, 4)
JOB_UNITS = 128
JOB_WIDTH = 16
REPEATS = 3
PER_UNIT = 1536
STORAGE = Path("/dev/shm")
# -----------------------------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(w), int(u)) for w, u in (part.split("x") for part in text.split(",") if part))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    p.add_argument("--offline", type=_sizes, default=OFFLINE, help="WxU,... checkpoints for reshard/consolidate")
    p.add_argument("--plan", type=_sizes, default=PLAN, help="WxU,... sizes planned for one rank")
    p.add_argument("--fresh", type=_sizes, default=FRESH, help="WxU,... checkpoints re-cut in fresh interpreters")
    p.add_argument("--jobs", type=lambda s: tuple(int(x) for x in s.split(",")), default=JOBS, help="job world sizes")
    p.add_argument("--skip-jobs", action="store_true")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--dir", type=Path, default=STORAGE, help="where checkpoints are written (default tmpfs)")
    p.add_argument("--name", default="scale", help="the results files' stem")
    return p.parse_args(argv)


def _make(world_size: int, units: int, src: Path) -> None:
    lay = scale_ops.layout(units, world_size, PER_UNIT)
    reshard(scale_ops.full_dict(lay), world_size, src, layout=Manifest.from_layout(lay, save_id="layout"))


def _operations(src: Path, new_size: int, root: Path) -> dict[str, Callable[[], Any]]:
    """What is measured of the checkpoint in ``src``, re-cut to ``new_size`` ranks: ours and the floors."""
    files = sorted(src.glob("optim-*"))
    return {
        "inspect": lambda: scale_ops.inspect(src),
        "floor_reshard": lambda: scale_ops.floor_reshard(files, new_size, root / "floor-r"),
        "floor_recut": lambda: scale_ops.floor_recut(src, new_size, root / "floor-u"),
        "reshard": lambda: reshard(src, new_size, root / "resharded"),
        "floor_consolidate": lambda: scale_ops.floor_consolidate(files, root / "floor-c"),
        "consolidate": lambda: save_durably(consolidate(src), root / "full.pt"),
    }


def offline(world_size: int, units: int, root: Path) -> dict[str, Any]:
    """One checkpoint of ``units`` at ``world_size``: made, inspected, resharded, consolidated; and the floors."""
    new_size, src = world_size * 3 // 4, root / "src"
    root.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"world_size": world_size, "units": units, "to": new_size}
    row["make_s"], row["make_rss"], _ = in_child(lambda: _make(world_size, units, src))
    row["disk_bytes"] = scale_ops.disk_bytes(src)
    measured = _operations(src, new_size, root)
    for name, fn in measured.items():
        row[f"{name}_s"], row[f"{name}_rss"] = _median(fn)
    _, rss, planned = in_child(
        lambda: scale_ops.plan_one_rank(units, world_size, PER_UNIT, from_file=src, traced=False)
    )
    manifest_bytes = sum(p.stat().st_size for p in src.glob("manifest.*"))
    row["plan_from_file"] = {"world_size": world_size, "units": units, "source": "file", "rss": rss,
                             "manifest_bytes": manifest_bytes, **planned}
    row["resharded_disk_bytes"] = scale_ops.disk_bytes(root / "resharded")
    row["floor_disk_bytes"] = scale_ops.disk_bytes(root / "floor-r")
    row["reshard_x_floor"] = row["reshard_s"] / row["floor_reshard_s"]
    row["reshard_x_recut"] = row["reshard_s"] / row["floor_recut_s"]
    row["consolidate_x_floor"] = row["consolidate_s"] / row["floor_consolidate_s"]
    return row


def _median(fn: Any) -> tuple[float, int]:
    """Median seconds and largest peak RSS growth of ``fn`` in forked children: 3 runs if one is under 2 s, else 1."""
    runs = [in_child(fn)]
    if runs[0][0] < 2:
        runs += [in_child(fn) for _ in range(2)]
    return sorted(r[0] for r in runs)[len(runs) // 2], max(r[1] for r in runs)


def first_and_second(world_size: int, units: int, root: Path, repeats: int) -> dict[str, Any]:
    """``--fresh``'s row: the checkpoint made, its byte floor measured (median in forked children), then
    ``reshard``'s first and second call in ``repeats`` fresh interpreters (:mod:`.fresh`)."""
    src = root / "src"
    in_child(lambda: _make(world_size, units, src))
    files = sorted(src.glob("optim-*"))
    floor, _ = _median(lambda: scale_ops.floor_reshard(files, world_size * 3 // 4, root / "floor"))
    try:
        return fixed_costs(world_size, units, src, root, floor, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def warm_up(root: Path) -> None:
    """Every measured path once, in this process, on 2 units at 2 ranks: the forked children then start with
    everything imported and every one-time cost paid (as a long-running tool would)."""
    _make(2, 2, root / "src")
    for fn in _operations(root / "src", 1, root).values():
        fn()
    scale_ops.plan_one_rank(2, 4, PER_UNIT, traced=False)
    shutil.rmtree(root, ignore_errors=True)


def planning(sizes: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    rows = []
    for world_size, units in sizes:
        _, rss, result = in_child(lambda: scale_ops.plan_one_rank(units, world_size, PER_UNIT))
        rows.append({"world_size": world_size, "units": units, "source": "dict", "rss": rss, **result})
    return rows


def jobs(world_sizes: tuple[int, ...], repeats: int, root: Path) -> list[dict[str, Any]]:
    rows, previous = [], None
    for world_size in sorted(world_sizes, reverse=True):
        own = root / f"job{world_size}"
        other = str(root / f"job{previous}") if previous == 2 * world_size else None
        t0 = time.perf_counter()
        results = spawn.run_ranks(scale_job.run, world_size, JOB_UNITS, JOB_WIDTH, str(own), other, repeats)
        row = {**results[0], "job_s": time.perf_counter() - t0, "disk_bytes": scale_ops.disk_bytes(own)}
        if other is not None:
            row["from"] = previous
            row["other_x_same"] = row["load_other_s"] / row["load_same_s"]
        rows.append(row)
        print(f"  job W={world_size}: {time.perf_counter() - t0:.0f} s", flush=True)
        previous = world_size
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="fsdp-optim-scale-", dir=args.dir))
    try:
        where = f"{machine()}, load {os.getloadavg()[0]:.1f}"
        result: dict[str, Any] = {"machine": where, "commit": package(), "per_unit": PER_UNIT, "offline": [], "planning": [], "jobs": [], "fresh": []}
        warm_up(root / "warm-up")
        for world_size, units in args.offline:
            print(f"offline W={world_size} units={units}", flush=True)
            result["offline"].append(offline(world_size, units, root / f"off-{world_size}x{units}"))
            shutil.rmtree(root / f"off-{world_size}x{units}", ignore_errors=True)
        print("planning", flush=True)
        result["planning"] = planning(args.plan) + [r["plan_from_file"] for r in result["offline"]]
        for world_size, units in args.fresh:
            print(f"fresh W={world_size} units={units}", flush=True)
            result["fresh"].append(first_and_second(world_size, units, root / f"fresh-{world_size}x{units}", args.repeats))
        if not args.skip_jobs:
            print(f"jobs W={args.jobs}", flush=True)
            result["jobs"] = jobs(args.jobs, args.repeats, root)
        result["seconds"] = time.perf_counter() - started
        command = f"python -m benchmarks.scale {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()
        result["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command}
        result["targets"] = {f"{r['world_size']}x{r['units']} {name}": met for r in result["fresh"] for name, met in (
            ("second <= 2x floor", r["second_x_floor"] <= 2), ("first - second <= 0.1 s", r["first_minus_second_s"] <= 0.1))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = tables(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.md").write_text(text + "\n")
    drawn = bool(result["offline"]) and plot(result, args.out / f"{args.name}.png")
    print(f"wrote {args.out}/{args.name}.{{json,md{',png' if drawn else ''}}} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
