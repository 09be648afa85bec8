"""Checkpoint benchmark results: rows with ratios to the floor and to DCP, the issue's targets, training overhead.

Rows are built with ``report.record`` (the gather benchmark's), so both benchmarks' JSON read alike; this
module adds the DCP ratio, the asynchronous saves' time until durable, bytes on disk and, for the
training runs, the overhead of one checkpoint against that round's run without checkpoints.
"""

from __future__ import annotations

import statistics
from typing import Any

from .. import report
from ..measure import Measurement, NotAvailable

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


def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
    results: dict[str, Measurement | NotAvailable] = payload["results"]
    out = []
    for method in sorted(results, key=lambda m: ORDER.index(m) if m in ORDER else len(ORDER)):
        value = results[method]
        row = report.record(model, world_size, payload["full_bytes"], method, value, results.get(FLOOR_OF.get(method, "")))
        row["disk_bytes"] = payload["disk"].get(method)
        row["other_world_size"] = payload.get("other_world_size")
        row["reshard_to"] = payload.get("reshard_to")
        peer = results.get(DCP_OF.get(method, ""))
        if isinstance(value, Measurement) and isinstance(peer, Measurement) and method not in BASELINE_OF:
            row["x_dcp"] = value.median_s / peer.median_s
        durable = value.extra.get("durable_s") if isinstance(value, Measurement) else None
        if durable:
            row["durable_median_s"] = statistics.median(durable)
            floor = results.get("floor_save")
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


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per (target, model, world size); ``met`` is None where it could not be measured."""
    at = {(r["model"], r["world_size"], r["method"]): r for r in rows}
    verdicts = []
    for model, ws in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        for name, method, against, limit in TARGETS:
            row = at.get((model, ws, method))
            value, detail = None, ""
            if row is None:
                detail = "not run here"
            elif "na" in row:
                detail = f"not measured: {row['na']}"
            elif (row.get("note") or "").startswith("wrong output"):
                detail = f"wrong result: {row['note']}"
            else:
                key = {"floor": "x_floor", "dcp": "x_dcp", "overhead_dcp": "overhead_x_dcp"}[against]
                value = row.get(key)
                base = at.get((model, ws, FLOOR_OF.get(method, "") if against == "floor" else DCP_OF.get(method, "")))
                if value is None:
                    detail = "no comparison measured" + (f" (DCP overhead {base['overhead_s'] * 1e3:.0f} ms <= 0)" if base and base.get("overhead_s") is not None else "")
                elif against == "overhead_dcp":
                    detail = f"{row['overhead_s'] * 1e3:.0f} ms vs {base['overhead_s'] * 1e3:.0f} ms per checkpoint"  # type: ignore[index]
                else:
                    detail = f"{row['median_s'] * 1e3:.0f} ms vs {base['median_s'] * 1e3:.0f} ms"  # type: ignore[index]
            verdicts.append(
                {
                    "target": name,
                    "model": model,
                    "world_size": ws,
                    "value": value,
                    "limit": limit,
                    "met": None if value is None and not detail.startswith("wrong") else (value is not None and value <= limit),
                    "detail": detail,
                }
            )
    return verdicts


def wrong_results(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if (r.get("note") or "").startswith(("wrong output", "result not checked"))]
