"""The object-storage benchmark's rows (ratios to the floors and to DCP, the async save's time until committed, the
upload part of ``save_checkpoint``, each method's throughput over the ranks' state bytes), its targets and tables,
on ``benchmarks.report``."""

from __future__ import annotations

import statistics
from typing import Any

from .. import report
from ..measure import Measurement
from ..peak import MiB
from ..report import Row
from ..whole.report import line, notes, sections

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



def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[Row]:
    state = sum(payload.get("own_bytes") or [0])
    out = []
    for row, value in report.compared(model, world_size, state, payload["results"], order=ORDER, floor_of=FLOOR_OF, dcp_of=DCP_OF):
        method = row["method"]
        for key in ("rss_recipient_x_full", "rss_recipient_x_floor", "rss_other_x_floor"):
            row.pop(key, None)
        if isinstance(value, Measurement):
            offline = method.startswith(("offline", "floor_r", "floor_c"))
            moved = value.extra.get("read_bytes", 0) + (value.extra.get("written_bytes") or 0) if offline else state
            row |= {"moved_bytes": moved, "gb_per_s": moved / value.median_s / 1e9 if moved else None}
        if method == "whole_save" and payload.get("upload_s"):
            row["upload_median_s"] = statistics.median(payload["upload_s"])
        if method == "whole_load_other":
            row |= {"other_world_size": payload.get("other_world_size"), "fetched_bytes": payload.get("recut_fetched_bytes"), "held_bytes": payload.get("recut_held_bytes")}
        out.append(row)
    return out


def _bytes(row: Row, limit: Any) -> tuple[float | None, bool | None, str]:
    fetched, held = row.get("fetched_bytes"), row.get("held_bytes")
    if not fetched or not held:
        return None, None, "not counted"
    return fetched / held, fetched / held <= (limit or 0), f"{fetched / MiB:,.1f} MiB fetched (GET bodies at the proxy) for {held / MiB:,.1f} MiB held"


def targets(rows: list[Row]) -> list[Row]:
    """One verdict per (target, model, world size) that has rows; ``met`` None where not measured or no limit."""
    return report.check_targets(rows, TARGETS, FLOOR_OF, DCP_OF, special={"bytes": _bytes}, skip_missing=True)


HEAD = ("method", "median ms", "spread", "x floor", "x DCP", "GB/s", "MiB moved")


def _cells(row: Row) -> list[str]:
    if "na" in row:
        return [f"n/a: {row['na']}"] + [""] * 5
    extra = f"; committed {report.ms(row['durable_median_s'])}" if row.get("durable_median_s") else ""
    extra += f"; upload part {report.ms(row['upload_median_s'])}" if row.get("upload_median_s") else ""
    return [report.ms(row["median_s"]) + extra + report.mark(row), f"{report.spread(row):.0%}", report.fmt(row, "x_floor", ".2f"), report.fmt(row, "x_dcp", ".2f"),
            f"{row['gb_per_s']:.2f}" if row.get("gb_per_s") else "", f"{row['moved_bytes'] / MiB:,.0f}" if row.get("moved_bytes") else ""]


def console(rows: list[Row]) -> str:
    return report.by_group(rows, HEAD, line(LABELS, _cells), (70, 40, 7, 8, 6, 6, 9))


def markdown(rows: list[Row], meta: dict[str, Any], png_name: str | None) -> str:
    rep = report.Report("Object-storage checkpoint benchmark", meta).add(
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
    )
    rep.targets(targets(rows), "## Targets (issue 25)", value=".3f")
    return notes(sections(rep, rows, HEAD, _cells, LABELS), rows, meta, LABELS, skip="offline, one process").text()
