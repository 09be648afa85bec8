"""Tables and the plot of ``benchmarks.scale`` (see its docstring for what each number is)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _get(row: dict[str, Any], key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "n/a"


def tables(result: dict[str, Any]) -> str:
    out = [f"Machine: {result['machine']}; commit {result['commit']}; {result.get('seconds', 0):.0f} s in all.", ""]
    if result["offline"]:
        out += ["Offline (one process; seconds, peak RSS growth in MiB; floor = the same files read with the plain "
                "loader, the same bytes written to as many files, fsync each; re-cut floor = that plus the manifest "
                "as plain JSON and every (unit, key) re-cut per output rank):", ""]
        out.append(_table(
            ["W -> W'", "units", "disk MiB", "make s", "inspect s", "reshard s", "floor s", "x floor", "re-cut floor s",
             "x re-cut", "RSS",
             "consolidate s", "floor s", "x floor", "RSS"],
            [[f"{r['world_size']} -> {r['to']}", str(r["units"]), f"{r['disk_bytes'] / MIB:.1f}", f"{r['make_s']:.1f}",
              f"{r['inspect_s']:.2f}", f"{r['reshard_s']:.2f}", f"{r['floor_reshard_s']:.3f}",
              f"{r['reshard_x_floor']:.1f}", _get(r, "floor_recut_s", ".3f"), _get(r, "reshard_x_recut", ".2f"),
              f"{r['reshard_rss'] / MIB:.0f}", f"{r['consolidate_s']:.2f}",
              f"{r['floor_consolidate_s']:.3f}", f"{r['consolidate_x_floor']:.1f}", f"{r['consolidate_rss'] / MIB:.0f}"]
             for r in result["offline"]],
        ))
        out.append("")
    if result["planning"]:
        out += ["Planning one rank (re-cut W -> 3W/4): parse + check the manifest, one plan, the rank's reads "
                "and the rank files they touch (seconds; tracemalloc peak and child RSS growth in MiB):", ""]
        out.append(_table(
            ["W", "units", "manifest from", "read s", "plan s", "rank s", "total s", "traced peak", "RSS", "files read"],
            [[str(r["world_size"]), str(r["units"]),
              r["source"] + (f" ({r['manifest_bytes'] / MIB:.1f} MiB)" if "manifest_bytes" in r else ""),
              f"{r['read_s']:.3f}", f"{r['plan_s']:.3f}", f"{r['rank_s']:.4f}", f"{r['total_s']:.3f}",
              f"{r['peak_traced'] / MIB:.1f}" if "peak_traced" in r else "n/a", f"{r['rss'] / MIB:.0f}", str(r["files"])]
             for r in result["planning"]],
        ))
        out.append("")
    if result["jobs"]:
        out += ["In a job (fsdp_optim FSDP, gloo, 128 units; median seconds, slowest rank; other-W = the checkpoint "
                "of the job of 2W ranks, re-cut on load):", ""]
        out.append(_table(
            ["W", "state KiB/rank", "gather s", "save s", "load same-W s", "load 2W -> W s", "x same-W",
             "peak RSS/rank MiB", "disk MiB"],
            [[str(r["world_size"]), f"{r['state_bytes'] / 1024:.0f}", f"{r['gather_s']:.3f}", f"{r['save_s']:.3f}",
              f"{r['load_same_s']:.3f}", f"{r['load_other_s']:.3f}" if "load_other_s" in r else "n/a",
              f"{r['other_x_same']:.2f}" if "other_x_same" in r else "n/a", f"{r['peak_rss_max'] / MIB:.0f}",
              f"{r['disk_bytes'] / MIB:.1f}"]
             for r in result["jobs"]],
        ))
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    off = result["offline"]
    if off:
        ax = axes[0]
        for units in sorted({r["units"] for r in off}):
            rows = [r for r in off if r["units"] == units]
            ws = [r["world_size"] for r in rows]
            ax.plot(ws, [r["reshard_s"] for r in rows], "o-", label=f"reshard, {units} units")
            ax.plot(ws, [r["floor_reshard_s"] for r in rows], "o--", label=f"byte floor, {units} units")
            if all("floor_recut_s" in r for r in rows):
                ax.plot(ws, [r["floor_recut_s"] for r in rows], "o:", label=f"re-cut floor, {units} units")
            ax.plot(ws, [r["consolidate_s"] for r in rows], "s-", label=f"consolidate, {units} units")
        ticks = sorted({r["world_size"] for r in off})
        ax.set(xscale="log", yscale="log", xlabel="source world size W", ylabel="seconds", title="offline W -> 3W/4")
        ax.set_xticks(ticks, [str(w) for w in ticks], minor=False)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=7)
    plan = [r for r in result["planning"] if r["source"] == "dict"]
    if plan:
        ax = axes[1]
        for units in sorted({r["units"] for r in plan}):
            rows = [r for r in plan if r["units"] == units]
            ax.plot([r["world_size"] for r in rows], [r["total_s"] for r in rows], "o-", label=f"{units} units")
        ax.axhline(1.0, color="grey", ls=":", label="target 1 s")
        ticks = sorted({r["world_size"] for r in plan})
        ax.set(xscale="log", yscale="log", xlabel="world size W", ylabel="seconds", title="planning one rank")
        ax.set_xticks(ticks, [str(w) for w in ticks], minor=False)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=7)
    jobs = result["jobs"]
    for ax, shown in zip(axes, (off, plan, jobs)):
        if not shown:
            ax.axis("off")
    if jobs:
        ax = axes[2]
        ws = [r["world_size"] for r in jobs]
        for key, label in (("gather_s", "gather"), ("save_s", "save"), ("load_same_s", "load same-W"),
                           ("load_other_s", "load 2W -> W")):
            pts = [(r["world_size"], r[key]) for r in jobs if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set(xscale="log", xlabel="job world size W", ylabel="seconds", title=f"in a job, {jobs[0]['units']} units")
        ax.set_xticks(ws, [str(w) for w in ws], minor=False)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
