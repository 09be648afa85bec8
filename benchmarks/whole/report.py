"""Whole-state benchmark results: rows with ratios to the floor and to DCP, the issue's targets, the tables.

Rows are built with ``report.record`` (the gather benchmark's) so every benchmark's JSON reads alike; this module
adds the DCP ratio, the async saves' time until durable, bytes on disk, and each recorded rank's own shard bytes
(weights + optimizer state) beside its peak RSS growth.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .. import report
from ..measure import Measurement, MiB, NotAvailable

FLOOR_OF = {
    "whole_save": "floor_save",
    "whole_async": "floor_save",
    "dcp_save": "floor_save",
    "dcp_async": "floor_save",
    "fullsd_save": "floor_save",
    "whole_load_same": "floor_load",
    "whole_load_other": "floor_load",
    "dcp_load_same": "floor_load",
    "fullsd_load": "floor_load",
}
DCP_OF = {
    "whole_save": "dcp_save",
    "whole_async": "dcp_async",
    "whole_load_same": "dcp_load_same",
    "whole_consolidate": "dcp_consolidate",
}
LABELS = {
    "floor_save": "floor: per-rank torch.save (weights + optim) + fsync",
    "whole_save": "ours save_checkpoint",
    "dcp_save": "DCP dcp.save(get_state_dict)",
    "whole_async": "ours async whole-state save, blocking part",
    "dcp_async": "DCP dcp.async_save, blocking part",
    "fullsd_save": "fairscale full state_dict() + gather, rank 0 torch.save",
    "floor_load": "floor: per-rank torch.load",
    "whole_load_same": "ours load_checkpoint, same W",
    "dcp_load_same": "DCP load + set_state_dict, same W",
    "whole_load_other": "ours load_checkpoint, other W + other nesting",
    "fullsd_load": "fairscale full torch.load + load_state_dict",
    "whole_consolidate": "ours consolidate + torch.save, offline (model + optimizer)",
    "dcp_consolidate": "DCP dcp_to_torch_save, offline (model + optimizer)",
}
ORDER = tuple(LABELS)
SLACK = 64 * MiB  # RSS growth allowed above a rank's own shard bytes
# (name, method, against, limit): against "floor" / "dcp" compares latency, "own" peak RSS growth.
TARGETS = (
    ("save <= 1.15x floor", "whole_save", "floor", 1.15),
    ("save <= DCP save", "whole_save", "dcp", 1.0),
    ("load same W <= 1.2x floor", "whole_load_same", "floor", 1.2),
    ("load other W + nesting <= 1.3x floor", "whole_load_other", "floor", 1.3),
    ("save RSS growth <= own shard + 64 MiB", "whole_save", "own", None),
    ("load same W RSS growth <= own shard + 64 MiB", "whole_load_same", "own", None),
    ("load other W RSS growth <= own shard + 64 MiB", "whole_load_other", "own", None),
    ("async blocking part <= 0.25x DCP async_save's", "whole_async", "dcp", 0.25),
    ("offline consolidate <= DCP dcp_to_torch_save", "whole_consolidate", "dcp", 1.0),
)


def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
    results: dict[str, Measurement | NotAvailable] = payload["results"]
    out = []
    for method in sorted(results, key=lambda m: ORDER.index(m) if m in ORDER else len(ORDER)):
        value = results[method]
        row = report.record(model, world_size, 0, method, value, results.get(FLOOR_OF.get(method, "")))
        row.pop("rss_recipient_x_full", None)
        row["disk_bytes"] = payload["disk"].get(method)
        row["other_world_size"] = payload.get("other_world_size") if method == "whole_load_other" else None
        owned = payload["own_bytes"]["nested" if method == "whole_load_other" else "own"]
        row["own_bytes"] = owned[:2]  # ranks 0 and 1, whose growth is recorded
        peer = results.get(DCP_OF.get(method, ""))
        if isinstance(value, Measurement) and isinstance(peer, Measurement):
            row["x_dcp"] = value.median_s / peer.median_s
        durable = value.extra.get("durable_s") if isinstance(value, Measurement) else None
        if durable:
            row["durable_median_s"] = statistics.median(durable)
        if isinstance(value, Measurement):
            row["rss_excess"] = max(g - own for g, own in zip(_growths(row), row["own_bytes"]))
        out.append(row)
    return out


def _growths(row: dict[str, Any]) -> list[int]:
    return [row["rss_recipient"]] + ([row["rss_other"]] if row.get("rss_other") is not None else [])


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per (target, model, world size); ``met`` is None where it could not be measured or has no limit."""
    at = {(r["model"], r["world_size"], r["method"]): r for r in rows}
    verdicts = []
    for model, ws in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        for name, method, against, limit in TARGETS:
            row = at.get((model, ws, method))
            value, met, detail = _verdict(row, against, limit, at.get((model, ws, (FLOOR_OF if against == "floor" else DCP_OF).get(method, ""))))
            verdicts.append({"target": name, "model": model, "world_size": ws, "value": value, "limit": limit, "met": met, "detail": detail})
    return verdicts


def _verdict(row: dict[str, Any] | None, against: str, limit: float | None, base: dict[str, Any] | None) -> tuple[float | None, bool | None, str]:
    if row is None:
        return None, None, "not run here"
    if "na" in row:
        return None, None, row["na"]
    if (row.get("note") or "").startswith(("wrong output", "result not checked")):
        return None, False, row["note"]
    if against == "own":
        growth = ", ".join(f"rank {r}: {g / MiB:,.0f} MiB for own {o / MiB:,.0f} MiB" for r, (g, o) in enumerate(zip(_growths(row), row["own_bytes"])))
        return row["rss_excess"] / MiB, row["rss_excess"] <= SLACK, f"{growth} (value: MiB above own)"
    value = row.get("x_floor" if against == "floor" else "x_dcp")
    if value is None or base is None:
        return None, None, "no comparison measured"
    detail = f"{row['median_s'] * 1e3:,.0f} ms vs {base['median_s'] * 1e3:,.0f} ms"
    return value, None if limit is None else value <= limit, detail


# ---------------------------------------------------------------------------------------------------
# Tables


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if abs(seconds) >= 0.01 else f"{seconds * 1e3:.2f}"


def _fmt(row: dict[str, Any], key: str, spec: str, scale: float = 1.0) -> str:
    return format(row[key] / scale, spec) if row.get(key) is not None else ""


def _cells(row: dict[str, Any]) -> list[str]:
    if "na" in row:
        return [f"n/a: {row['na']}"] + [""] * 7
    mark = " ⚠ WRONG" if (row.get("note") or "").startswith("wrong output") else " †" if row.get("note") else ""
    durable = f"; durable {_ms(row['durable_median_s'])}" if row.get("durable_median_s") else ""
    calls = f" ({len(row['times_s'])} call{'s' if len(row['times_s']) > 1 else ''})" if row["method"].startswith("fullsd") else ""
    own = " / ".join(f"{o / MiB:,.0f}" for o in row["own_bytes"])
    return [
        _ms(row["median_s"]) + durable + calls + mark,
        f"{report.spread(row):.0%}",
        _fmt(row, "x_floor", ".2f"),
        _fmt(row, "x_dcp", ".2f"),
        f"{row['rss_recipient'] / MiB:,.0f}" + (f" / {row['rss_other'] / MiB:,.0f}" if row.get("rss_other") is not None else ""),
        own,
        f"{row['rss_excess'] / MiB:+,.0f}",
        _fmt(row, "disk_bytes", ",.0f", MiB),
    ]


HEAD = ("method", "median ms", "spread", "x floor", "x DCP", "RSS growth r0 / r1 MiB", "own shard r0 / r1 MiB", "above own MiB", "disk MiB")


def console(rows: list[dict[str, Any]]) -> str:
    widths = (56, 24, 7, 8, 6, 22, 22, 13, 9)
    lines = []
    for (model, ws) in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        lines += [f"-- {model}, W={ws}", "  ".join(h[:w].ljust(w) for h, w in zip(HEAD, widths))]
        for r in (r for r in rows if (r["model"], r["world_size"]) == (model, ws)):
            cells = [LABELS.get(r["method"], r["method"])] + _cells(r)
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def verdicts_text(rows: list[dict[str, Any]]) -> str:
    lines = []
    for v in targets(rows):
        met = "PASS" if v["met"] else "MISS" if v["met"] is False else "info" if v["value"] is not None else "n/a "
        value = f"{v['value']:.2f}" if v["value"] is not None else "-"
        lines.append(f"{met} {v['target']:<50} {v['model']:>5} W={v['world_size']}  {value:>7}  {v['detail']}")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], png_name: str | None) -> str:
    lines = [
        f"# Whole-state checkpoint benchmark ({meta['finished']})",
        "",
        f"Machine: {meta['machine']}. Backend: {meta['backend']}. {meta['versions']}.",
        f"Command: `{meta['command']}`; wall time {meta['wall_s'] / 60:.1f} min; load average before/after: "
        f"{meta['load_before']} / {meta['load_after']} (per job: {meta['job_loads']}). Checkpoints written to {meta['storage']}.",
        f"Package measured: {meta['package']}.",
        f"Model: {meta['model']} ({meta['numel'] / 1e6:.1f}M parameters), Adam after {meta['steps']} step(s). Ours: fsdp_optim's "
        "(fairscale) FSDP, one unit per block plus the root; the other-W load goes into a unit per Linear plus the root. "
        "DCP: the same model under FSDP2 `fully_shard`, same batches. Weights, buffers and optimizer state in every checkpoint.",
        f"Each latency: median of {meta['repeats']} barrier-synchronised calls after {meta['warmup']} warm-up round(s), "
        f"methods interleaved round-robin, slowest rank per call (fairscale's full state dicts: {meta['peer_repeats']} call(s), "
        "no warm-up, for their memory). Peak RSS growth: VmHWM during the call minus VmRSS before it, largest over the "
        "timed calls, ranks 0 and 1; `own shard`: the rank's weight shards + optimizer state bytes. "
        "⚠ WRONG: the result differs from the saved state; †: see notes.",
        "",
        "## Targets (issue 28)",
        "",
        "| target | model | W | value | limit | verdict | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in targets(rows):
        verdict = "PASS" if v["met"] else "**MISS**" if v["met"] is False else "info" if v["value"] is not None else "n/a"
        limit = "64 MiB" if v["target"].endswith("64 MiB") else (f"{v['limit']}" if v["limit"] is not None else "-")
        value = f"{v['value']:.2f}" if v["value"] is not None else "-"
        lines.append(f"| {v['target']} | {v['model']} | {v['world_size']} | {value} | {limit} | {verdict} | {v['detail']} |")
    lines.append("")
    for (model, ws) in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        lines += [f"## {model}, W={ws}", "", "| " + " | ".join(HEAD) + " |", "|---" * len(HEAD) + "|"]
        for r in (r for r in rows if (r["model"], r["world_size"]) == (model, ws)):
            label = LABELS.get(r["method"], r["method"])
            if r.get("other_world_size"):
                label += f" (saved at W={r['other_world_size']})"
            lines.append(f"| {label} | " + " | ".join(_cells(r)) + " |")
        lines.append("")
    notes = [(r["method"], r["world_size"], r["note"]) for r in rows if r.get("note")]
    if notes or meta.get("diagnosis"):
        lines += ["## Notes", ""]
        lines += [f"- {LABELS.get(m, m)} (W={w}): {n}" for m, w, n in notes]
        lines += [f"- {d}" for d in meta.get("diagnosis", [])]
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    return False  # the tables say it; no plot for this benchmark


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, name: str) -> dict[str, Path]:
    return report.write_files(rows, meta, out_dir, name, plot=plot, markdown=markdown, targets=targets)
