"""Tables and the plot of ``benchmarks.scale`` (see its docstring for what each number is), on ``benchmarks.report``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import report
from ..peak import MiB


def _get(row: dict[str, Any], key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "n/a"


def _offline(r: dict[str, Any]) -> list[str]:
    return [f"{r['world_size']} -> {r['to']}", str(r["units"]), f"{r['disk_bytes'] / MiB:.1f}", f"{r['make_s']:.1f}", f"{r['inspect_s']:.2f}",
            f"{r['reshard_s']:.2f}", f"{r['floor_reshard_s']:.3f}", f"{r['reshard_x_floor']:.1f}", _get(r, "floor_recut_s", ".3f"), _get(r, "reshard_x_recut", ".2f"),
            f"{r['reshard_rss'] / MiB:.0f}", f"{r['consolidate_s']:.2f}", f"{r['floor_consolidate_s']:.3f}", f"{r['consolidate_x_floor']:.1f}", f"{r['consolidate_rss'] / MiB:.0f}"]


def _planning(r: dict[str, Any]) -> list[str]:
    source = r["source"] + (f" ({r['manifest_bytes'] / MiB:.1f} MiB)" if "manifest_bytes" in r else "")
    traced = f"{r['peak_traced'] / MiB:.1f}" if "peak_traced" in r else "n/a"
    return [str(r["world_size"]), str(r["units"]), source, f"{r['read_s']:.3f}", f"{r['plan_s']:.3f}", f"{r['rank_s']:.4f}", f"{r['total_s']:.3f}", traced,
            f"{r['rss'] / MiB:.0f}", str(r["files"])]


def _job(r: dict[str, Any]) -> list[str]:
    return [str(r["world_size"]), f"{r['state_bytes'] / 1024:.0f}", f"{r['gather_s']:.3f}", f"{r['save_s']:.3f}", f"{r['load_same_s']:.3f}",
            _get(r, "load_other_s", ".3f"), _get(r, "other_x_same", ".2f"), f"{r['peak_rss_max'] / MiB:.0f}", f"{r['disk_bytes'] / MiB:.1f}"]


def _fresh(r: dict[str, Any]) -> list[str]:
    return [f"{r['world_size']} -> {r['to']}", str(r["units"]), str(r["files"]), f"{r['import_s']:.3f}", f"{r['first_s']:.3f}", f"{r['second_s']:.3f}",
            f"{r['floor_s']:.3f}", f"{r['second_x_floor']:.1f}", f"{r['first_minus_second_s']:.3f}"]


SECTIONS = (  # (result key, lead-in, columns, cells of a row)
    ("offline", "Offline (one process; seconds, peak RSS growth in MiB; floor = the same files read with the plain loader, the same bytes written to "
     "as many files, fsync each; re-cut floor = that plus the manifest as plain JSON and every (unit, key) re-cut per output rank):",
     ["W -> W'", "units", "disk MiB", "make s", "inspect s", "reshard s", "floor s", "x floor", "re-cut floor s", "x re-cut", "RSS", "consolidate s",
      "floor s", "x floor", "RSS"], _offline),
    ("planning", "Planning one rank (re-cut W -> 3W/4): parse + check the manifest, one plan, the rank's reads and the rank files they touch "
     "(seconds; tracemalloc peak and child RSS growth in MiB):",
     ["W", "units", "manifest from", "read s", "plan s", "rank s", "total s", "traced peak", "RSS", "files read"], _planning),
    ("jobs", "In a job (fsdp_optim FSDP, gloo, 128 units; median seconds, slowest rank; other-W = the checkpoint of the job of 2W ranks, re-cut on load):",
     ["W", "state KiB/rank", "gather s", "save s", "load same-W s", "load 2W -> W s", "x same-W", "peak RSS/rank MiB", "disk MiB"], _job),
    ("fresh", "Fixed costs: reshard W -> 3W/4 in fresh interpreters, torch imported first (median seconds; first = the import of fsdp_optim.reshard "
     "plus the first call; floor = the byte floor of the offline table; targets: second <= 2x floor, first - second <= 0.1 s):",
     ["W -> W'", "units", "files", "import s", "first s", "second s", "floor s", "second x floor", "first - second s"], _fresh),
)


def tables(result: dict[str, Any]) -> str:
    out = [f"Machine: {result['machine']}; commit {result['commit']}; {result.get('seconds', 0):.0f} s in all.", ""]
    for key, lead, columns, cells in SECTIONS:
        if result.get(key):
            out += [lead, "", *report.table(columns, [cells(r) for r in result[key]]), ""]
    return "\n".join(out[:-1] if result["jobs"] else out)


def plot(result: dict[str, Any], path: Path) -> bool:
    off, jobs = result["offline"], result["jobs"]
    plan = [r for r in result["planning"] if r["source"] == "dict"]
    offline_series = []
    for units in sorted({r["units"] for r in off}):
        rows = [r for r in off if r["units"] == units]
        for key, style, label in (("reshard_s", "o-", "reshard"), ("floor_reshard_s", "o--", "byte floor"), ("floor_recut_s", "o:", "re-cut floor"), ("consolidate_s", "s-", "consolidate")):
            if all(key in r for r in rows):
                offline_series.append((f"{label}, {units} units", [(r["world_size"], r[key]) for r in rows], style, None, 1.5))
    plan_series = [(f"{u} units", [(r["world_size"], r["total_s"]) for r in plan if r["units"] == u], "o-", None, 1.5) for u in sorted({r["units"] for r in plan})]
    job_series = [(label, [(r["world_size"], r[key]) for r in jobs if key in r], "o-", None, 1.5)
                  for key, label in (("gather_s", "gather"), ("save_s", "save"), ("load_same_s", "load same-W"), ("load_other_s", "load 2W -> W"))]
    log = {"xscale": "log", "yscale": "log", "ylabel": "seconds"}
    panels = [
        {"series": offline_series, "title": "offline W -> 3W/4", "xlabel": "source world size W", **log},
        {"series": plan_series, "title": "planning one rank", "xlabel": "world size W", "hline": (1.0, "target 1 s"), **log},
        {"series": job_series if jobs else [], "title": f"in a job, {jobs[0]['units'] if jobs else 0} units", "xlabel": "job world size W", "xscale": "log", "ylabel": "seconds"},
    ]
    return report.lines(path, "", [panels], size=(5.0, 4.2))
