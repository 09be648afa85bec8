"""Object-storage benchmark results: rows with ratios to the floors and to DCP, the issue's targets, the tables.

Rows are built with ``report.record`` (the gather benchmark's) so every benchmark's JSON reads alike; this module adds
the DCP ratio, the async save's time until committed, the upload part of ``save_checkpoint`` and the throughput of
each method over the bytes of the ranks' state (weights + optimizer state).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .. import report
from ..measure import Measurement, NotAvailable

FLOOR_OF = {
    "whole_save": "floor_upload",
    "whole_async": "floor_upload",
    "dcp_save": "floor_upload",
    "whole_load_same": "floor_download",
    "whole_load_other": "floor_download",
    "dcp_load_same": "floor_download",
    "offline_reshard": "floor_reshard",
    "offline_consolidate": "floor_consolidate",
}
DCP_OF = {"whole_save": "dcp_save", "whole_load_same": "dcp_load_same", "whole_load_other": "dcp_load_same"}
LABELS = {
    "floor_upload": "floor: s3fs pipe_file of the rank's state bytes (50 MiB parts, 10 in flight)",
    "whole_save": "ours save_checkpoint(model, optim, store)",
    "dcp_save": "DCP dcp.save(get_state_dict), FsspecWriter",
    "whole_async": "ours async_save_checkpoint, blocking part",
    "floor_download": "floor: s3fs ranged GETs of the rank's bytes (16 MiB, 8 in flight)",
    "whole_load_same": "ours load_checkpoint, same W",
    "dcp_load_same": "DCP dcp.load + set_state_dict, FsspecReader, same W",
    "whole_load_other": "ours load_checkpoint, other W + other nesting",
    "floor_reshard": "floor: fetch every source object + put the reshard's output bytes",
    "offline_reshard": "ours reshard(s3://src, W', s3://out), one process",
    "floor_consolidate": "floor: fetch every source object + put the consolidated file's bytes",
    "offline_consolidate": "ours fsdp-optim consolidate s3://src -o s3://out/full.pt, one process",
}
ORDER = tuple(LABELS)
# (name, method, against, limit): against "floor" / "dcp" compares latency, "bytes" the re-cut load's fetched bytes.
TARGETS = (
    ("save <= 1.1x upload floor", "whole_save", "floor", 1.1),
    ("save <= DCP FsspecWriter", "whole_save", "dcp", 1.0),
    ("load same W <= 1.1x download floor", "whole_load_same", "floor", 1.1),
    ("load other W + nesting <= 1.2x download floor", "whole_load_other", "floor", 1.2),
    ("load same W <= DCP FsspecReader", "whole_load_same", "dcp", 1.0),
    ("load other W <= DCP FsspecReader (same W)", "whole_load_other", "dcp", 1.0),
    ("re-cut load: bytes fetched <= 1.02x bytes held", "whole_load_other", "bytes", 1.02),
    ("offline reshard <= 1.3x fetch + upload floor", "offline_reshard", "floor", 1.3),
    ("offline consolidate <= 1.3x fetch + upload floor", "offline_consolidate", "floor", 1.3),
    ("async save, blocking part (x upload floor)", "whole_async", "floor", None),
)


def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
    results: dict[str, Measurement | NotAvailable] = payload["results"]
    state = sum(payload.get("own_bytes") or [0])
    out = []
    for method in sorted(results, key=lambda m: ORDER.index(m) if m in ORDER else len(ORDER)):
        value = results[method]
        row = report.record(model, world_size, state, method, value, results.get(FLOOR_OF.get(method, "")))
        for key in ("rss_recipient_x_full", "rss_recipient_x_floor", "rss_other_x_floor"):
            row.pop(key, None)
        peer = results.get(DCP_OF.get(method, ""))
        if isinstance(value, Measurement) and isinstance(peer, Measurement):
            row["x_dcp"] = value.median_s / peer.median_s
        if isinstance(value, Measurement):
            durable = value.extra.get("durable_s")
            if durable:
                row["durable_median_s"] = statistics.median(durable)
            moved = value.extra.get("read_bytes", 0) + (value.extra.get("written_bytes") or 0) if method.startswith(("offline", "floor_r", "floor_c")) else state
            row["moved_bytes"] = moved
            row["gb_per_s"] = moved / value.median_s / 1e9 if moved else None
        if method == "whole_save" and payload.get("upload_s"):
            row["upload_median_s"] = statistics.median(payload["upload_s"])
        if method == "whole_load_other":
            row["other_world_size"] = payload.get("other_world_size")
            row["fetched_bytes"] = payload.get("recut_fetched_bytes")
            row["held_bytes"] = payload.get("recut_held_bytes")
        out.append(row)
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per (target, model, world size) that has rows; ``met`` None where not measured or no limit."""
    at = {(r["model"], r["world_size"], r["method"]): r for r in rows}
    verdicts = []
    for model, ws in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        for name, method, against, limit in TARGETS:
            row = at.get((model, ws, method))
            if row is None:
                continue
            base = at.get((model, ws, (DCP_OF if against == "dcp" else FLOOR_OF).get(method, "")))
            value, met, detail = _verdict(row, against, limit, base)
            verdicts.append({"target": name, "model": model, "world_size": ws, "value": value, "limit": limit, "met": met, "detail": detail})
    return verdicts


def _verdict(row: dict[str, Any], against: str, limit: float | None, base: dict[str, Any] | None) -> tuple[float | None, bool | None, str]:
    if "na" in row:
        return None, None, row["na"]
    if (row.get("note") or "").startswith(("wrong output", "result not checked")):
        return None, False, row["note"]
    if against == "bytes":
        fetched, held = row.get("fetched_bytes"), row.get("held_bytes")
        if not fetched or not held:
            return None, None, "not counted"
        return fetched / held, fetched / held <= (limit or 0), f"{fetched / 2**20:,.1f} MiB fetched (GET bodies at the proxy) for {held / 2**20:,.1f} MiB held"
    value = row.get("x_floor" if against == "floor" else "x_dcp")
    if value is None or base is None:
        return None, None, "no comparison measured"
    detail = f"{row['median_s'] * 1e3:,.0f} ms vs {base['median_s'] * 1e3:,.0f} ms"
    return value, None if limit is None else value <= limit, detail


# ---------------------------------------------------------------------------------------------------
# Tables


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if abs(seconds) >= 0.01 else f"{seconds * 1e3:.2f}"


def _cells(row: dict[str, Any]) -> list[str]:
    if "na" in row:
        return [f"n/a: {row['na']}"] + [""] * 5
    mark = " ⚠ WRONG" if (row.get("note") or "").startswith("wrong output") else " †" if row.get("note") else ""
    extra = f"; committed {_ms(row['durable_median_s'])}" if row.get("durable_median_s") else ""
    extra += f"; upload part {_ms(row['upload_median_s'])}" if row.get("upload_median_s") else ""
    return [
        _ms(row["median_s"]) + extra + mark,
        f"{report.spread(row):.0%}",
        f"{row['x_floor']:.2f}" if row.get("x_floor") is not None else "",
        f"{row['x_dcp']:.2f}" if row.get("x_dcp") is not None else "",
        f"{row['gb_per_s']:.2f}" if row.get("gb_per_s") else "",
        f"{row['moved_bytes'] / 2**20:,.0f}" if row.get("moved_bytes") else "",
    ]


HEAD = ("method", "median ms", "spread", "x floor", "x DCP", "GB/s", "MiB moved")


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return list(dict.fromkeys((r["model"], r["world_size"]) for r in rows))


def _label(row: dict[str, Any]) -> str:
    label = LABELS.get(row["method"], row["method"])
    if row.get("other_world_size"):
        label += f" (saved at W={row['other_world_size']})"
    return label


def console(rows: list[dict[str, Any]]) -> str:
    widths = (70, 40, 7, 8, 6, 6, 9)
    lines = []
    for model, ws in _groups(rows):
        lines += [f"-- {model}, W={ws}", "  ".join(h[:w].ljust(w) for h, w in zip(HEAD, widths))]
        for r in (r for r in rows if (r["model"], r["world_size"]) == (model, ws)):
            cells = [_label(r)] + _cells(r)
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def verdicts_text(rows: list[dict[str, Any]]) -> str:
    lines = []
    for v in targets(rows):
        met = "PASS" if v["met"] else "MISS" if v["met"] is False else "info" if v["value"] is not None else "n/a "
        value = f"{v['value']:.3f}" if v["value"] is not None else "-"
        lines.append(f"{met} {v['target']:<50} {v['model']:>5} W={v['world_size']}  {value:>7}  {v['detail']}")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], png_name: str | None) -> str:
    lines = [
        f"# Object-storage checkpoint benchmark ({meta['finished']})",
        "",
        f"Machine: {meta['machine']}. Backend: {meta['backend']}. {meta['versions']}.",
        f"Command: `{meta['command']}`; wall time {meta['wall_s'] / 60:.1f} min; load average before/after: "
        f"{meta['load_before']} / {meta['load_after']} (per job: {meta['job_loads']}).",
        f"Server: {meta['server']}.",
        f"Package measured: {meta['package']}.",
        f"Models: {meta['models']}, Adam after {meta['steps']} step(s). Ours: fsdp_optim's (fairscale) FSDP, one unit per "
        "block plus the root; the other-W load goes into a unit per Linear plus the root. DCP: the same model under "
        "FSDP2 `fully_shard`, same batches, `FsspecWriter`/`FsspecReader` with the same URL scheme and storage options. "
        "Weights, buffers and optimizer state in every checkpoint.",
        f"Each latency: median of {meta['repeats']} barrier-synchronised calls after {meta['warmup']} warm-up round(s), "
        "methods interleaved round-robin, slowest rank per call; before each save the server compacts what the call "
        f"before replaced (untimed). Offline tools: one process, median of {meta['offline_repeats']} calls after "
        f"{meta['warmup']} warm-up round(s), on {meta['offline_source']}. GB/s: the ranks' state bytes (weights + "
        "optimizer state; offline: bytes read + written) over the median. ⚠ WRONG: the result differs from the saved "
        "state; †: see notes.",
        "",
        "## Targets (issue 25)",
        "",
        "| target | model | W | value | limit | verdict | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in targets(rows):
        verdict = "PASS" if v["met"] else "**MISS**" if v["met"] is False else "info" if v["value"] is not None else "n/a"
        limit = f"{v['limit']}" if v["limit"] is not None else "-"
        value = f"{v['value']:.3f}" if v["value"] is not None else "-"
        lines.append(f"| {v['target']} | {v['model']} | {v['world_size']} | {value} | {limit} | {verdict} | {v['detail']} |")
    lines.append("")
    for model, ws in _groups(rows):
        title = f"## {model}, W={ws}" if ws else f"## {model}, offline (one process)"
        lines += [title, "", "| " + " | ".join(HEAD) + " |", "|---" * len(HEAD) + "|"]
        for r in (r for r in rows if (r["model"], r["world_size"]) == (model, ws)):
            lines.append(f"| {_label(r)} | " + " | ".join(_cells(r)) + " |")
        lines.append("")
    notes = [(r["method"], r["world_size"], r["note"]) for r in rows if r.get("note") and r["note"] != "offline, one process"]
    if notes or meta.get("diagnosis"):
        lines += ["## Notes", ""]
        lines += [f"- {LABELS.get(m, m)} (W={w}): {n}" for m, w, n in notes]
        lines += [f"- {d}" for d in meta.get("diagnosis", [])]
        lines.append("")
    return "\n".join(lines)


def _no_plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    return False  # the tables say it


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, name: str) -> dict[str, Path]:
    return report.write_files(rows, meta, out_dir, name, plot=_no_plot, markdown=markdown, targets=targets)
