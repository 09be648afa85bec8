"""The whole-state benchmark's rows (ratios to the floor and to DCP, the async saves' time until durable, bytes on disk,
each recorded rank's own shard bytes beside its peak RSS growth), its targets and tables, on ``benchmarks.report``."""

from __future__ import annotations

from typing import Any

from .. import report
from ..measure import Measurement
from ..peak import MiB
from ..report import Row

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
DCP_OF = {"whole_save": "dcp_save", "whole_async": "dcp_async", "whole_load_same": "dcp_load_same", "whole_consolidate": "dcp_consolidate"}
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



def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[Row]:
    out = []
    for row, value in report.compared(model, world_size, 0, payload["results"], order=ORDER, floor_of=FLOOR_OF, dcp_of=DCP_OF):
        method = row["method"]
        row.pop("rss_recipient_x_full", None)
        row["disk_bytes"] = payload["disk"].get(method)
        row["other_world_size"] = payload.get("other_world_size") if method == "whole_load_other" else None
        row["own_bytes"] = payload["own_bytes"]["nested" if method == "whole_load_other" else "own"][:2]  # ranks 0 and 1, whose growth is recorded
        if isinstance(value, Measurement):
            row["rss_excess"] = max(g - own for g, own in zip(_growths(row), row["own_bytes"]))
        out.append(row)
    return out


def _growths(row: Row) -> list[int]:
    return [row["rss_recipient"]] + ([row["rss_other"]] if row.get("rss_other") is not None else [])


def _own(row: Row, limit: Any) -> tuple[float, bool, str]:
    growth = ", ".join(f"rank {r}: {g / MiB:,.0f} MiB for own {o / MiB:,.0f} MiB" for r, (g, o) in enumerate(zip(_growths(row), row["own_bytes"])))
    return row["rss_excess"] / MiB, row["rss_excess"] <= SLACK, f"{growth} (value: MiB above own)"


def targets(rows: list[Row]) -> list[Row]:
    """One verdict per (target, model, world size); ``met`` is None where it could not be measured or has no limit."""
    return report.check_targets(rows, TARGETS, FLOOR_OF, DCP_OF, special={"own": _own})


HEAD = ("method", "median ms", "spread", "x floor", "x DCP", "RSS growth r0 / r1 MiB", "own shard r0 / r1 MiB", "above own MiB", "disk MiB")


def _cells(row: Row) -> list[str]:
    if "na" in row:
        return [f"n/a: {row['na']}"] + [""] * 7
    durable = f"; durable {report.ms(row['durable_median_s'])}" if row.get("durable_median_s") else ""
    calls = f" ({len(row['times_s'])} call{'s' if len(row['times_s']) > 1 else ''})" if row["method"].startswith("fullsd") else ""
    rss = f"{row['rss_recipient'] / MiB:,.0f}" + (f" / {row['rss_other'] / MiB:,.0f}" if row.get("rss_other") is not None else "")
    own = " / ".join(f"{o / MiB:,.0f}" for o in row["own_bytes"])
    return [report.ms(row["median_s"]) + durable + calls + report.mark(row), f"{report.spread(row):.0%}", report.fmt(row, "x_floor", ".2f"),
            report.fmt(row, "x_dcp", ".2f"), rss, own, f"{row['rss_excess'] / MiB:+,.0f}", report.fmt(row, "disk_bytes", ",.0f", MiB)]


def line(labels: dict[str, str], cells: Any) -> Any:
    """A row of the tables: its label (an other-W load: with the world size that saved its checkpoint), then ``cells``."""
    return lambda r: [labels.get(r["method"], r["method"]) + (f" (saved at W={r['other_world_size']})" if r.get("other_world_size") else "")] + cells(r)


def console(rows: list[Row]) -> str:
    return report.by_group(rows, HEAD, line(LABELS, _cells), (56, 24, 7, 8, 6, 22, 22, 13, 9))


def sections(rep: report.Report, rows: list[Row], head: tuple[str, ...], cells: Any, labels: dict[str, str]) -> report.Report:
    """A table per (model, world size) (world size 0: the offline tools, one process)."""
    for model, ws in report.groups(rows):
        rep.add(f"## {model}, W={ws}" if ws else f"## {model}, offline (one process)", "")
        rep.table(head, [line(labels, cells)(r) for r in rows if (r["model"], r["world_size"]) == (model, ws)])
    return rep


def markdown(rows: list[Row], meta: dict[str, Any], png_name: str | None) -> str:
    rep = report.Report("Whole-state checkpoint benchmark", meta).add(
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
    )
    limit = lambda v: "64 MiB" if v["target"].endswith("64 MiB") else ("-" if v["limit"] is None else f"{v['limit']}")  # noqa: E731
    rep.targets(targets(rows), "## Targets (issue 28)", limit=limit)
    return notes(sections(rep, rows, HEAD, _cells, LABELS), rows, meta, LABELS).text()


def notes(rep: report.Report, rows: list[Row], meta: dict[str, Any], labels: dict[str, str], skip: str = "") -> report.Report:
    """One note a row that has one (but ``skip``), then the run's diagnosis lines."""
    found = [(r["method"], r["world_size"], r["note"]) for r in rows if r.get("note") and r["note"] != skip]
    if found or meta.get("diagnosis"):
        rep.add("## Notes", "", *(f"- {labels.get(m, m)} (W={w}): {n}" for m, w, n in found), *(f"- {d}" for d in meta.get("diagnosis", [])), "")
    return rep
