"""The gather benchmark's rows, targets (issue 3), Markdown and plot, on ``benchmarks.report``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import report
from ..peak import MiB
from ..report import Row

FLOOR = "floor_p2p_fresh"
COPY_FLOOR = "floor_copy"
PEERS = ("fairscale", "fsdp1", "fsdp2")
LABELS = {
    "ours": "ours (tensor, default)",
    "ours_object": "ours (object: broadcast_object_list)",
    "fairscale": "fairscale gather_full_optim_state_dict",
    "fsdp1": "PyTorch FSDP1 full_optim_state_dict(rank0_only)",
    "fsdp2": "PyTorch FSDP2 get_optimizer_state_dict(full, cpu_offload)",
    "floor_gather": "floor: dist.gather, preallocated",
    "floor_p2p_warm": "floor: p2p into warm memory",
    "floor_p2p_fresh": "floor: p2p into fresh memory",
    "get_shard": "ours get_shard_from_optim_state_dict",
    "floor_copy": "floor: fresh copy of the shard's bytes",
}
GATHER_ROWS = ("ours", "ours_object", "fairscale", "fsdp1", "fsdp2", "floor_gather", "floor_p2p_warm", FLOOR)
SHARD_ROWS = ("get_shard", COPY_FLOOR)
TARGET_MODELS = ("25M", "100M")
STYLES = {  # method -> (colour, line style, width)
    "ours": ("C0", "o-", 2.5),
    "ours_object": ("C0", "o--", 1.2),
    "fairscale": ("C1", "s-", 1.5),
    "fsdp1": ("C2", "^-", 1.5),
    "fsdp2": ("C3", "v-", 1.5),
    "floor_gather": ("0.6", ":", 1.2),
    "floor_p2p_warm": ("0.4", "-.", 1.2),
    FLOOR: ("k", "--", 1.5),
}


def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[Row]:
    results = payload["results"]
    return [
        report.record(model, world_size, payload["full_bytes"], m, v, results.get(COPY_FLOOR if m in SHARD_ROWS else FLOOR))
        for m, v in results.items()
    ]


def _targets_at(at: dict[tuple[str, int, str], Row], model: str, ws: int) -> list[Row]:
    """The targets of one (model, world size): fresh-memory floor, fastest peer, object path, memory."""
    ours = at[(model, ws, "ours")]
    ok = {p: at[(model, ws, p)] for p in (FLOOR, "ours_object", *PEERS) if (model, ws, p) in at and "na" not in at[(model, ws, p)]}
    out = []
    if FLOOR in ok:
        ratio = ours["median_s"] / ok[FLOOR]["median_s"]
        detail = f"{ours['median_s'] * 1e3:.0f} ms vs {ok[FLOOR]['median_s'] * 1e3:.0f} ms"
        out.append(report.verdict("ours <= 1.3x fresh p2p floor", model, ws, ratio, "<= 1.3", ratio <= 1.3, detail))
    peers = [ok[p] for p in PEERS if p in ok]
    if peers:
        fastest = min(peers, key=lambda r: r["median_s"])
        speedup = fastest["median_s"] / ours["median_s"]
        detail = f"fastest peer {fastest['method']} {fastest['median_s'] * 1e3:.0f} ms"
        out.append(report.verdict(">= 2.5x faster than fastest peer", model, ws, speedup, ">= 2.5", speedup >= 2.5, detail))
    if ws >= 4 and "ours_object" in ok:
        speedup = ok["ours_object"]["median_s"] / ours["median_s"]
        detail = f"object {ok['ours_object']['median_s'] * 1e3:.0f} ms"
        out.append(report.verdict(">= 10x faster than object path (W>=4)", model, ws, speedup, ">= 10", speedup >= 10.0, detail))
    rss = ours["rss_recipient"] / ours["full_bytes"]
    detail = f"{ours['rss_recipient'] / MiB:.1f} MiB for {ours['full_bytes'] / MiB:.1f} MiB"
    out.append(report.verdict("recipient peak RSS growth <= 1.05x full", model, ws, rss, "<= 1.05", rss <= 1.05, detail))
    if ours.get("rss_other") is not None:
        other = ours["rss_other"] / MiB
        out.append(report.verdict("other rank peak RSS growth < 32 MiB", model, ws, other, "< 32 MiB", ours["rss_other"] < 32 * MiB, f"{other:.1f} MiB"))
    return out


def targets(rows: list[Row]) -> list[Row]:
    """One verdict per (target, model, world size) where both sides were measured."""
    at = report.index(rows)
    return [
        v
        for model, ws in sorted(report.groups(rows), key=lambda g: (list(dict.fromkeys(r["model"] for r in rows)).index(g[0]), g[1]))
        if model in TARGET_MODELS and 2 <= ws <= 8 and "na" not in at.get((model, ws, "ours"), {"na": ""})
        for v in _targets_at(at, model, ws)
    ]


def _ms(row: Row | None) -> str:
    if row is None:
        return ""
    if "na" in row:
        return f"n/a: {row['na']}"
    return report.ms(row["median_s"]) + (f" ({row['x_floor']:.2f}x)" if row.get("x_floor") is not None else "") + report.mark(row, " ⚠")


def _mib(key: str) -> Any:
    def cell(row: Row | None) -> str:
        if row is None:
            return ""
        if "na" in row:
            return "n/a"
        if row.get(key) is None:
            return ""
        ratio = row.get(f"{key}_x_floor") if key == "rss_recipient" else None
        return f"{row[key] / MiB:,.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

    return cell


def markdown(rows: list[Row], meta: dict[str, Any], png_name: str | None) -> str:
    rep = report.Report("Optimizer-state gather benchmark", meta).add(
        f"Command: `{meta['command']}`; wall time {meta['wall_s'] / 60:.1f} min; load average before/after: {meta['load_before']} / {meta['load_after']}.",
        f"Each figure: median of {meta['repeats']} barrier-synchronised calls after {meta['warmup']} warm-up round(s), methods interleaved "
        f"round-robin, slowest rank per call; Adam after {meta['steps']} training steps; one FSDP unit per block plus the root.",
        "Latency in ms, with the ratio to the fresh-memory point-to-point floor in parentheses (get_shard: to a fresh copy of the "
        "shard's bytes). ⚠: wrong result; †: see notes.",
    )
    if meta.get("oversubscribed"):
        rep.add(f"World sizes above {meta['cores']} oversubscribe the {meta['cores']} cores.")
    rep.add("").targets(targets(rows), "## Targets (issue 3)", words=("yes", "**no**", "n/a", "n/a"), column="met")
    methods = GATHER_ROWS + SHARD_ROWS
    for model in dict.fromkeys(r["model"] for r in rows):
        full = next(r["full_bytes"] for r in rows if r["model"] == model)
        multi = [w for w in sorted({r["world_size"] for r in rows if r["model"] == model}) if w > 1]
        rep.add(f"## {model} model (full Adam state {full / MiB:,.0f} MiB)", "", "Latency, ms (x floor):", "")
        rep.by_world_size(rows, model, methods, _ms, LABELS)
        rep.add("Peak RSS growth, recipient (rank 0), MiB (x the floor's growth, which is the full state's bytes):", "")
        rep.by_world_size(rows, model, methods, _mib("rss_recipient"), LABELS)
        if multi:
            rep.add("Peak RSS growth, one other rank (rank 1), MiB (the floors allocate nothing there):", "")
            rep.by_world_size(rows, model, methods, _mib("rss_other"), LABELS, sizes=multi)
    return rep.notes(rows, LABELS).image(png_name, "latency against world size").text()


def plot(rows: list[Row], path: Path, title: str) -> bool:
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        series = []
        for method in GATHER_ROWS:
            points = [(r["world_size"], r["median_s"] * 1e3) for r in rows if r["model"] == model and r["method"] == method and "na" not in r]
            if points:
                colour, style, width = STYLES[method]
                series.append((LABELS[method], points, style, colour, width))
        panels.append({"title": f"{model} model", "series": series, "ylabel": "gather latency, ms (median)", "yscale": "log"})
    return report.lines(path, title, [panels], size=(6.0, 5.0), dpi=120, legend="shared")


def console(rows: list[Row]) -> str:
    """Every method's median, spread, ratio and RSS growth, for the terminal."""
    return report.measurements(rows, [*report.MEASURED, *report.RSS, ("note", 80, lambda r: r.get("note", ""))], 16)
