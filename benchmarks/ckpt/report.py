"""The checkpoint benchmark's rows (ratios to the floor and to DCP, the async saves' time until durable, bytes on
disk, the training runs' overhead per checkpoint), its targets, Markdown and plot, on ``benchmarks.report``."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .. import report
from ..measure import Measurement
from ..peak import MiB
from ..report import Row

FLOOR_OF = {
    "ours_save": "floor_save",
    "ours_async": "floor_save",
    "dcp_save": "floor_save",
    "dcp_async": "floor_save",
    "ours_load_same": "floor_load",
    "ours_load_other": "floor_load",
    "dcp_load_same": "floor_load",
    "dcp_load_other": "floor_load",
    "ours_consolidate": "floor_consolidate",
    "dcp_to_torch_save": "floor_consolidate",
    "ours_reshard": "floor_reshard",
}
DCP_OF = {
    "ours_save": "dcp_save",
    "ours_async": "dcp_async",
    "ours_load_same": "dcp_load_same",
    "ours_load_other": "dcp_load_other",
    "ours_consolidate": "dcp_to_torch_save",
    "train_ours_sync": "train_dcp_sync",
    "train_ours_async": "train_dcp_async",
}
BASELINE_OF = {
    "train_ours_sync": "train_ours_none",
    "train_ours_async": "train_ours_none",
    "train_dcp_sync": "train_dcp_none",
    "train_dcp_async": "train_dcp_none",
}
LABELS = {
    "ours_save": "ours save_sharded_optim_state",
    "ours_async": "ours async save, blocking part",
    "dcp_save": "DCP dcp.save",
    "dcp_async": "DCP dcp.async_save, blocking part",
    "floor_save": "floor: per-rank torch.save + fsync",
    "ours_load_same": "ours load, same W",
    "ours_load_other": "ours load, from other W",
    "dcp_load_same": "DCP load + set_optimizer_state_dict, same W",
    "dcp_load_other": "DCP load + set_optimizer_state_dict, from other W",
    "floor_load": "floor: per-rank torch.load",
    "ours_consolidate": "ours consolidate + torch.save (offline)",
    "dcp_to_torch_save": "DCP dcp_to_torch_save (offline)",
    "floor_consolidate": "floor: read all, write one file",
    "ours_reshard": "ours reshard to M ranks (offline)",
    "floor_reshard": "floor: read all, write M files",
    "train_ours_none": "train, fairscale FSDP, no checkpoint",
    "train_ours_sync": "train + ours sync save",
    "train_ours_async": "train + ours async save",
    "train_dcp_none": "train, FSDP2, no checkpoint",
    "train_dcp_sync": "train + DCP save",
    "train_dcp_async": "train + DCP async_save",
}
ORDER = tuple(LABELS)
TRAIN = tuple(m for m in ORDER if m.startswith("train_"))




def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[Row]:
    results = payload["results"]
    out = []
    for row, _value in report.compared(model, world_size, payload["full_bytes"], results, order=ORDER, floor_of=FLOOR_OF, dcp_of=DCP_OF):
        method = row["method"]
        row |= {"disk_bytes": payload["disk"].get(method), "other_world_size": payload.get("other_world_size"), "reshard_to": payload.get("reshard_to")}
        if method in BASELINE_OF:
            row.pop("x_dcp", None)
        if row.get("durable_median_s"):
            floor, peer = results.get("floor_save"), results.get(DCP_OF.get(method, ""))
            if isinstance(floor, Measurement):
                row["durable_x_floor"] = row["durable_median_s"] / floor.median_s
            if isinstance(peer, Measurement) and peer.extra.get("durable_s"):
                row["durable_x_dcp"] = row["durable_median_s"] / statistics.median(peer.extra["durable_s"])
        out.append(row)
    _training(out, payload.get("train"))
    return out


def _training(rows: list[dict[str, Any]], train: dict[str, Any] | None) -> None:
    """Per round: (run time - the same round's run without checkpoints) / checkpoints; then the median."""
    if not train:
        return
    at = {r["method"]: r for r in rows}
    for method, base in BASELINE_OF.items():
        row, none = at.get(method), at.get(base)
        if not row or not none or "na" in row or "na" in none:
            continue
        per_round = [(t - b) / train["checkpoints"] for t, b in zip(row["times_s"], none["times_s"])]
        row["overhead_s"] = statistics.median(per_round)
        row["overhead_range_s"] = (min(per_round), max(per_round))
    for row in (at.get(m) for m in TRAIN):
        if row and "na" not in row:
            row["steps_per_s"] = train["steps"] / row["median_s"]
    for method, peer in DCP_OF.items():
        row, other = at.get(method), at.get(peer)
        if method in BASELINE_OF and row and other and "overhead_s" in row and "overhead_s" in other:
            row["overhead_x_dcp"] = row["overhead_s"] / other["overhead_s"] if other["overhead_s"] > 0 else None


# The targets: (name, method, what it is divided by, limit).
TARGETS = (
    ("sync save <= 1.15x floor", "ours_save", "floor", 1.15),
    ("sync save <= dcp.save", "ours_save", "dcp", 1.0),
    ("load same W <= 1.2x floor", "ours_load_same", "floor", 1.2),
    ("load other W <= 1.5x this job's floor", "ours_load_other", "floor", 1.5),
    ("consolidate+save <= 1.1x floor", "ours_consolidate", "floor", 1.1),
    ("consolidate+save <= dcp_to_torch_save", "ours_consolidate", "dcp", 1.0),
    ("reshard <= 1.2x read-all-write-all floor", "ours_reshard", "floor", 1.2),
    ("async blocking <= 0.25x DCP async blocking", "ours_async", "dcp", 0.25),
    ("async training overhead/ckpt <= 0.5x DCP async's", "train_ours_async", "overhead_dcp", 0.5),
)



def _target(row: Row | None, against: str, base: Row | None) -> tuple[float | None, str]:
    if row is None:
        return None, "not run here"
    if "na" in row:
        return None, f"not measured: {row['na']}"
    if (row.get("note") or "").startswith("wrong output"):
        return None, f"wrong result: {row['note']}"
    value = row.get({"floor": "x_floor", "dcp": "x_dcp", "overhead_dcp": "overhead_x_dcp"}[against])
    if value is None:
        return None, "no comparison measured" + (f" (DCP overhead {base['overhead_s'] * 1e3:.0f} ms <= 0)" if base and base.get("overhead_s") is not None else "")
    if against == "overhead_dcp":
        return value, f"{row['overhead_s'] * 1e3:.0f} ms vs {base['overhead_s'] * 1e3:.0f} ms per checkpoint"  # type: ignore[index]
    return value, f"{row['median_s'] * 1e3:.0f} ms vs {base['median_s'] * 1e3:.0f} ms"  # type: ignore[index]


def targets(rows: list[Row]) -> list[Row]:
    """One verdict per (target, model, world size); ``met`` is None where it could not be measured."""
    at, out = report.index(rows), []
    for model, ws in report.groups(rows):
        for name, method, against, limit in TARGETS:
            base = at.get((model, ws, FLOOR_OF.get(method, "") if against == "floor" else DCP_OF.get(method, "")))
            value, detail = _target(at.get((model, ws, method)), against, base)
            met = None if value is None and not detail.startswith("wrong") else (value is not None and value <= limit)
            out.append(report.verdict(name, model, ws, value, limit, met, detail))
    return out


def _latency(row: Row | None) -> str:
    if row is None or "na" in row:
        return "" if row is None else "n/a"
    ratios = [f"{row['x_floor']:.2f}x fl" if row.get("x_floor") is not None else "", f"{row['x_dcp']:.2f}x dcp" if row.get("x_dcp") is not None else ""]
    text = report.ms(row["median_s"]) + (" (" + ", ".join(r for r in ratios if r) + ")" if any(ratios) else "")
    if row.get("durable_median_s") is not None:
        text += f"; durable {report.ms(row['durable_median_s'])}" + (f" ({row['durable_x_floor']:.2f}x fl)" if row.get("durable_x_floor") is not None else "")
    return text + report.mark(row)


def _training_cell(row: Row | None) -> str:
    if row is None or "na" in row:
        return "" if row is None else "n/a"
    text = f"{row['steps_per_s']:.2f} steps/s, ±{report.spread(row) / 2:.0%}"
    if row.get("overhead_s") is not None:
        lo, hi = row["overhead_range_s"]
        text += f"; {'+' if row['overhead_s'] >= 0 else ''}{report.ms(row['overhead_s'])} ms/ckpt [{report.ms(lo)}..{report.ms(hi)}]"
        text += f" ({row['overhead_x_dcp']:.2f}x dcp)" if row.get("overhead_x_dcp") is not None else ""
    return text + report.mark(row)


def _rss(row: Row | None) -> str:
    if row is None or "na" in row:
        return "" if row is None else "n/a"
    return f"{row['rss_recipient'] / MiB:,.0f}" + (f" / {row['rss_other'] / MiB:,.0f}" if row.get("rss_other") is not None else "")


def _disk(row: Row | None) -> str:
    return f"{row['disk_bytes'] / MiB:,.1f}" if row and row.get("disk_bytes") is not None else ""


def markdown(rows: list[Row], meta: dict[str, Any], png_name: str | None) -> str:
    t = meta.get("train")
    skipped = f"; skipped for time: {', '.join(meta['train_skipped'])}" if meta.get("train_skipped") else ""
    train = (f"Training runs: {t['steps']} Adam steps with a checkpoint after every {t['every']} ({t['checkpoints']} per run, the last one waited "
             f"for), {t['repeats']} runs per variant, variants interleaved{skipped}.") if t else "Training runs: not measured."
    rep = report.Report("Checkpoint benchmark", meta).add(
        f"Command: `{meta['command']}`; wall time {meta['wall_s'] / 60:.1f} min; load average before/after: "
        f"{meta['load_before']} / {meta['load_after']}. Checkpoints written to {meta['storage']}.",
        f"Package measured: {meta['package']}.",
        train,
        f"Optimizer state only, for both ours and DCP (Adam after {meta['steps']} steps; one FSDP unit per block plus "
        "the root; ours on fairscale FSDP, DCP on FSDP2 `fully_shard`, same model and batches).",
        f"Each latency: median of {meta['repeats']} barrier-synchronised calls after {meta['warmup']} warm-up round(s), "
        "methods interleaved round-robin, slowest rank per call. `x fl`: ratio to the floor of the same operation; "
        "`x dcp`: ratio to DCP's counterpart. ⚠ WRONG: the result differs from the saved state; †: see notes.",
        "",
    )
    rep.targets(targets(rows), "## Targets", words=("yes", "**no**", "n/a", "n/a"), column="met")
    bad = [r for r in rows if report.is_wrong(r)]
    rep.add(f"Correctness: {len(bad)} wrong or unchecked result(s) out of {sum('na' not in r for r in rows)}.", "")
    latency = tuple(m for m in ORDER if m not in TRAIN)
    for model in dict.fromkeys(r["model"] for r in rows):
        full = next(r["full_bytes"] for r in rows if r["model"] == model)
        pairs = sorted({(r["world_size"], r["other_world_size"], r["reshard_to"]) for r in rows if r["model"] == model})
        where = "; ".join(f"W={w}: other W {o}, reshard to {m}" for w, o, m in pairs)
        rep.add(f"## {model} model (full Adam state {full / MiB:,.0f} MiB)", "", f"Other world sizes: {where}.", "", "Latency, ms:", "")
        rep.by_world_size(rows, model, latency, _latency, LABELS)
        rep.add("Training run with a checkpoint every N steps (median; overhead per checkpoint against the same round's run without, "
                "[min..max] over rounds):", "").by_world_size(rows, model, TRAIN, _training_cell, LABELS)
        rep.add("Peak RSS growth, rank 0 / rank 1, MiB:", "").by_world_size(rows, model, ORDER, _rss, LABELS)
        rep.add("Bytes on disk, MiB (all ranks' files):", "").by_world_size(rows, model, latency, _disk, LABELS)
    return rep.notes(rows, LABELS).image(png_name, "checkpoint latency against world size").text()


OURS, DCP, FLOOR = "C0", "C1", "k"
# panel title -> series (method, value key, colour, line style, label suffix)
def _series(key: str, *methods: tuple[str, str, str]) -> tuple[tuple[str, str, str, str, str], ...]:
    return tuple((m, key, colour, style, "") for m, colour, style in methods)


PANELS: dict[str, tuple[tuple[str, str, str, str, str], ...]] = {
    "save, ms": _series("median_s", ("ours_save", OURS, "o-"), ("ours_async", OURS, "o--"))
    + (("ours_async", "durable_median_s", OURS, ":", " until durable"),)
    + _series("median_s", ("dcp_save", DCP, "s-"), ("dcp_async", DCP, "s--"))
    + (("dcp_async", "durable_median_s", DCP, ":", " until durable"),)
    + _series("median_s", ("floor_save", FLOOR, "--")),
    "load, ms": _series("median_s", ("ours_load_same", OURS, "o-"), ("ours_load_other", OURS, "o--"), ("dcp_load_same", DCP, "s-"),
                        ("dcp_load_other", DCP, "s--"), ("floor_load", FLOOR, "--")),
    "offline, ms": _series("median_s", ("ours_consolidate", OURS, "o-"), ("dcp_to_torch_save", DCP, "s-"), ("floor_consolidate", FLOOR, "--"),
                           ("ours_reshard", "C2", "o-"), ("floor_reshard", "C2", ":")),
    "training overhead per checkpoint, ms": _series("overhead_s", ("train_ours_sync", OURS, "o-"), ("train_ours_async", OURS, "o--"),
                                                    ("train_dcp_sync", DCP, "s-"), ("train_dcp_async", DCP, "s--")),
}  # fmt: skip


def plot(rows: list[Row], path: Path, title: str) -> bool:
    grid = []
    for model in dict.fromkeys(r["model"] for r in rows):
        panels = []
        for panel, series in PANELS.items():
            lines = []
            for method, key, colour, style, suffix in series:
                pts = [(r["world_size"], r[key] * 1e3) for r in rows if r["model"] == model and r["method"] == method and r.get(key) is not None]
                if pts:
                    lines.append((LABELS[method].split(",")[0] + suffix if suffix else LABELS[method], pts, style, colour, 2 if colour == OURS else 1.2))
            panels.append({"title": f"{model}: {panel}", "series": lines})
        grid.append(panels)
    return report.lines(path, title, grid)


def console(rows: list[Row]) -> str:
    overhead = lambda r: f"{r['overhead_s'] * 1e3:+.0f} ms/ckpt " if r.get("overhead_s") is not None else ""  # noqa: E731
    return report.measurements(rows, [*report.MEASURED, ("x dcp", 6, lambda r: report.fmt(r, "x_dcp", ".2f")), ("durable", 9, lambda r: report.fmt(r, "durable_median_s", ".3f")),
                                      *report.RSS, ("disk MiB", 9, lambda r: report.fmt(r, "disk_bytes", ".1f", MiB)), ("note", 40, lambda r: overhead(r) + r.get("note", ""))])  # fmt: skip
