"""Turn measurements into ratios, target verdicts, a markdown report, JSON and a PNG plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .measure import Measurement, MiB, NotAvailable

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

# Targets of issue 3, checked at world sizes 2..8 for the 25M and 100M models.
TARGET_MODELS = ("25M", "100M")
MAX_FLOOR_RATIO = 1.3
MIN_PEER_SPEEDUP = 2.5
MIN_OBJECT_SPEEDUP = 10.0
MAX_RECIPIENT_RSS = 1.05  # x full state bytes
MAX_OTHER_RSS = 32 * MiB


def record(model: str, world_size: int, full_bytes: int, method: str, value: Any, base: Any) -> dict[str, Any]:
    """One row of the JSON: the measurement and its ratios to ``base`` (the floor it is compared with)."""
    row: dict[str, Any] = {"model": model, "world_size": world_size, "method": method, "full_bytes": full_bytes}
    if isinstance(value, NotAvailable):
        row["na"] = value.reason
        return row
    assert isinstance(value, Measurement), f"{method}: unexpected {type(value).__name__}"
    row.update(asdict(value))
    row["median_s"] = value.median_s
    row["rss_recipient_x_full"] = value.rss_recipient / full_bytes if full_bytes else None
    if isinstance(base, Measurement):
        row["x_floor"] = value.median_s / base.median_s
        row["rss_recipient_x_floor"] = value.rss_recipient / base.rss_recipient if base.rss_recipient > 0 else None
        if value.rss_other is not None and base.rss_other:
            row["rss_other_x_floor"] = value.rss_other / base.rss_other
    return row


def rows_of(model: str, world_size: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
    results = payload["results"]
    out = []
    for method, value in results.items():
        base = results.get(COPY_FLOOR if method in SHARD_ROWS else FLOOR)
        out.append(record(model, world_size, payload["full_bytes"], method, value, base))
    return out


def _index(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(r["model"], r["world_size"], r["method"]): r for r in rows}


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per (target, model, world size) where both sides were measured."""
    at = _index(rows)
    verdicts = []

    def add(target: str, model: str, ws: int, value: float | None, limit: str, ok: bool | None, detail: str) -> None:
        verdicts.append(
            {
                "target": target,
                "model": model,
                "world_size": ws,
                "value": value,
                "limit": limit,
                "met": ok,
                "detail": detail,
            }
        )

    for model in sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m)):
        if model not in TARGET_MODELS:
            continue
        for ws in sorted({r["world_size"] for r in rows if r["model"] == model}):
            if not 2 <= ws <= 8:
                continue
            ours = at.get((model, ws, "ours"))
            if not ours or "na" in ours:
                continue
            floor = at.get((model, ws, FLOOR))
            if floor and "na" not in floor:
                ratio = ours["median_s"] / floor["median_s"]
                add(
                    "ours <= 1.3x fresh p2p floor",
                    model,
                    ws,
                    ratio,
                    "<= 1.3",
                    ratio <= MAX_FLOOR_RATIO,
                    f"{ours['median_s'] * 1e3:.0f} ms vs {floor['median_s'] * 1e3:.0f} ms",
                )
            peers = [at[(model, ws, p)] for p in PEERS if (model, ws, p) in at and "na" not in at[(model, ws, p)]]
            if peers:
                fastest = min(peers, key=lambda r: r["median_s"])
                speedup = fastest["median_s"] / ours["median_s"]
                add(
                    ">= 2.5x faster than fastest peer",
                    model,
                    ws,
                    speedup,
                    ">= 2.5",
                    speedup >= MIN_PEER_SPEEDUP,
                    f"fastest peer {fastest['method']} {fastest['median_s'] * 1e3:.0f} ms",
                )
            obj = at.get((model, ws, "ours_object"))
            if ws >= 4 and obj and "na" not in obj:
                speedup = obj["median_s"] / ours["median_s"]
                add(
                    ">= 10x faster than object path (W>=4)",
                    model,
                    ws,
                    speedup,
                    ">= 10",
                    speedup >= MIN_OBJECT_SPEEDUP,
                    f"object {obj['median_s'] * 1e3:.0f} ms",
                )
            rss = ours["rss_recipient"] / ours["full_bytes"]
            add(
                "recipient peak RSS growth <= 1.05x full",
                model,
                ws,
                rss,
                "<= 1.05",
                rss <= MAX_RECIPIENT_RSS,
                f"{ours['rss_recipient'] / MiB:.1f} MiB for {ours['full_bytes'] / MiB:.1f} MiB",
            )
            if ours.get("rss_other") is not None:
                other = ours["rss_other"] / MiB
                add(
                    "other rank peak RSS growth < 32 MiB",
                    model,
                    ws,
                    other,
                    "< 32 MiB",
                    ours["rss_other"] < MAX_OTHER_RSS,
                    f"{other:.1f} MiB",
                )
    return verdicts


# ---------------------------------------------------------------------------------------------------
# Markdown


def _ms(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if "na" in row:
        return f"n/a: {row['na']}"
    text = f"{row['median_s'] * 1e3:,.0f}" if row["median_s"] >= 0.01 else f"{row['median_s'] * 1e3:.2f}"
    if row.get("x_floor") is not None:
        text += f" ({row['x_floor']:.2f}x)"
    note = row.get("note") or ""
    return text + (" ⚠" if note.startswith("wrong output") else " †" if note else "")


def _mib(row: dict[str, Any] | None, key: str) -> str:
    if row is None:
        return ""
    if "na" in row:
        return "n/a"
    if row.get(key) is None:
        return ""
    text = f"{row[key] / MiB:,.1f}"
    ratio = row.get(f"{key}_x_floor") if key == "rss_recipient" else None
    return text + (f" ({ratio:.2f}x)" if ratio is not None else "")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], png_name: str | None) -> str:
    at = _index(rows)
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = [
        f"# Optimizer-state gather benchmark ({meta['finished']})",
        "",
        f"Machine: {meta['machine']}. Backend: {meta['backend']}. {meta['versions']}.",
        (
            f"Command: `{meta['command']}`; wall time {meta['wall_s'] / 60:.1f} min; "
            f"load average before/after: {meta['load_before']} / {meta['load_after']}."
        ),
        (
            f"Each figure: median of {meta['repeats']} barrier-synchronised calls after {meta['warmup']} warm-up "
            "round(s), methods interleaved round-robin, slowest rank per call; Adam after "
            f"{meta['steps']} training steps; one FSDP unit per block plus the root."
        ),
        (
            "Latency in ms, with the ratio to the fresh-memory point-to-point floor in parentheses "
            "(get_shard: to a fresh copy of the shard's bytes). ⚠: wrong result; †: see notes."
        ),
    ]
    if meta.get("oversubscribed"):
        lines.append(f"World sizes above {meta['cores']} oversubscribe the {meta['cores']} cores.")
    lines.append("")
    verdicts = targets(rows)
    if verdicts:
        lines += [
            "## Targets (issue 3)",
            "",
            "| target | model | W | value | limit | met | detail |",
            "|---|---|---|---|---|---|---|",
        ]
        for v in verdicts:
            lines.append(
                f"| {v['target']} | {v['model']} | {v['world_size']} | {v['value']:.2f} | {v['limit']} | "
                f"{'yes' if v['met'] else '**no**'} | {v['detail']} |"
            )
        lines.append("")
    for model in models:
        sizes = sorted({r["world_size"] for r in rows if r["model"] == model})
        full = next(r["full_bytes"] for r in rows if r["model"] == model)
        lines += [f"## {model} model (full Adam state {full / MiB:,.0f} MiB)", ""]
        head = "| method | " + " | ".join(f"W={w}" for w in sizes) + " |"
        rule = "|---|" + "---|" * len(sizes)
        lines += ["Latency, ms (x floor):", "", head, rule]
        for method in GATHER_ROWS + SHARD_ROWS:
            cells = [at.get((model, w, method)) for w in sizes]
            if any(cells):
                lines.append(f"| {LABELS[method]} | " + " | ".join(_ms(c) for c in cells) + " |")
        lines += [
            "",
            "Peak RSS growth, recipient (rank 0), MiB (x the floor's growth, which is the full state's bytes):",
            "",
            head,
            rule,
        ]
        for method in GATHER_ROWS + SHARD_ROWS:
            cells = [at.get((model, w, method)) for w in sizes]
            if any(cells):
                lines.append(f"| {LABELS[method]} | " + " | ".join(_mib(c, "rss_recipient") for c in cells) + " |")
        multi = [w for w in sizes if w > 1]
        if multi:
            lines += [
                "",
                "Peak RSS growth, one other rank (rank 1), MiB (the floors allocate nothing there):",
                "",
                "| method | " + " | ".join(f"W={w}" for w in multi) + " |",
                "|---|" + "---|" * len(multi),
            ]
            for method in GATHER_ROWS + SHARD_ROWS:
                cells = [at.get((model, w, method)) for w in multi]
                if any(cells):
                    lines.append(f"| {LABELS[method]} | " + " | ".join(_mib(c, "rss_other") for c in cells) + " |")
        lines.append("")
    notes = sorted({(r["method"], r.get("na") or r.get("note")) for r in rows if r.get("na") or r.get("note")})
    if notes:
        lines += ["## Notes", ""]
        for method, text in notes:
            where = ", ".join(
                f"{r['model']} W={r['world_size']}"
                for r in rows
                if r["method"] == method and (r.get("na") or r.get("note")) == text
            )
            lines.append(f"- {LABELS[method]}: {text} ({where})")
        lines.append("")
    if png_name:
        lines += [f"![latency against world size]({png_name})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Plot


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.0 * len(models) + 1, 5.6), squeeze=False)
    styles = {
        "ours": ("C0", "o-", 2.5),
        "ours_object": ("C0", "o--", 1.2),
        "fairscale": ("C1", "s-", 1.5),
        "fsdp1": ("C2", "^-", 1.5),
        "fsdp2": ("C3", "v-", 1.5),
        "floor_gather": ("0.6", ":", 1.2),
        "floor_p2p_warm": ("0.4", "-.", 1.2),
        FLOOR: ("k", "--", 1.5),
    }
    for ax, model in zip(axes[0], models):
        for method in GATHER_ROWS:
            points = sorted(
                (r["world_size"], r["median_s"] * 1e3)
                for r in rows
                if r["model"] == model and r["method"] == method and "na" not in r
            )
            if points:
                color, style, width = styles[method]
                ax.plot(*zip(*points), style, color=color, linewidth=width, label=LABELS[method], markersize=4)
        ax.set_yscale("log")
        ax.set_xlabel("world size")
        ax.set_ylabel("gather latency, ms (median)")
        ax.set_title(f"{model} model")
        ax.set_xticks(sorted({r["world_size"] for r in rows if r["model"] == model}))
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, name: str) -> dict[str, Path]:
    return write_files(rows, meta, out_dir, name, plot=plot, markdown=markdown, targets=targets)


def write_files(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    out_dir: Path,
    name: str,
    *,
    plot: Callable[[list[dict[str, Any]], Path, str], bool],
    markdown: Callable[[list[dict[str, Any]], dict[str, Any], str | None], str],
    targets: Callable[[list[dict[str, Any]]], Any],
) -> dict[str, Path]:
    """``<name>.md``, ``<name>.json`` and (when matplotlib is there) ``<name>.png`` of one benchmark's rows, made
    by that benchmark's ``plot``, ``markdown`` and ``targets``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / f"{name}.md", "json": out_dir / f"{name}.json", "png": out_dir / f"{name}.png"}
    has_png = plot(rows, paths["png"], f"{meta['machine']}\n{meta['backend']}, {meta['finished']}")
    paths["md"].write_text(markdown(rows, meta, paths["png"].name if has_png else None))
    paths["json"].write_text(json.dumps({"meta": meta, "targets": targets(rows), "rows": rows}, indent=1, default=str))
    if not has_png:
        paths.pop("png")
    return paths


def console(rows: list[dict[str, Any]]) -> str:
    """A compact table for the terminal: every method's median, ratio and RSS growth."""
    lines = [
        (
            f"{'model':>6} {'W':>2} {'method':<16} {'median ms':>10} {'spread':>7} {'x floor':>8} "
            f"{'rss0 MiB':>9} {'rss1 MiB':>9}  note"
        )
    ]
    for r in rows:
        if "na" in r:
            lines.append(f"{r['model']:>6} {r['world_size']:>2} {r['method']:<16} n/a: {r['na']}")
            continue
        ratio = f"{r['x_floor']:.2f}" if r.get("x_floor") is not None else ""
        other = f"{r['rss_other'] / MiB:.1f}" if r.get("rss_other") is not None else ""
        lines.append(
            f"{r['model']:>6} {r['world_size']:>2} {r['method']:<16} {r['median_s'] * 1e3:>10.1f} "
            f"{spread(r):>7.0%} {ratio:>8} "
            f"{r['rss_recipient'] / MiB:>9.1f} {other:>9}  {r.get('note', '')}"
        )
    return "\n".join(lines)


def spread(row: dict[str, Any]) -> float:
    """Relative spread of the timed calls (max-min over median), for noise judgement."""
    times = row.get("times_s") or []
    return (max(times) - min(times)) / statistics.median(times) if times else 0.0
