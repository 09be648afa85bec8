"""The checkpoint benchmark's console table, Markdown report, JSON and PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..measure import MiB
from ..report import spread, write_files
from .report import LABELS, ORDER, TRAIN, targets, wrong_results


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if abs(seconds) >= 0.01 else f"{seconds * 1e3:.2f}"


def _mark(row: dict[str, Any]) -> str:
    note = row.get("note") or ""
    return " ⚠ WRONG" if note.startswith("wrong output") else " †" if note else ""


def _latency(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if "na" in row:
        return "n/a"
    text = _ms(row["median_s"])
    ratios = [f"{row['x_floor']:.2f}x fl" if row.get("x_floor") is not None else ""]
    ratios.append(f"{row['x_dcp']:.2f}x dcp" if row.get("x_dcp") is not None else "")
    if any(ratios):
        text += " (" + ", ".join(r for r in ratios if r) + ")"
    if row.get("durable_median_s") is not None:
        text += f"; durable {_ms(row['durable_median_s'])}"
        if row.get("durable_x_floor") is not None:
            text += f" ({row['durable_x_floor']:.2f}x fl)"
    return text + _mark(row)


def _training(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if "na" in row:
        return "n/a"
    text = f"{row['steps_per_s']:.2f} steps/s, ±{spread(row) / 2:.0%}"
    if row.get("overhead_s") is not None:
        lo, hi = row["overhead_range_s"]
        text += f"; {'+' if row['overhead_s'] >= 0 else ''}{_ms(row['overhead_s'])} ms/ckpt [{_ms(lo)}..{_ms(hi)}]"
        if row.get("overhead_x_dcp") is not None:
            text += f" ({row['overhead_x_dcp']:.2f}x dcp)"
    return text + _mark(row)


def _rss(row: dict[str, Any] | None) -> str:
    if row is None or "na" in row:
        return "" if row is None else "n/a"
    other = f" / {row['rss_other'] / MiB:,.0f}" if row.get("rss_other") is not None else ""
    return f"{row['rss_recipient'] / MiB:,.0f}{other}"


def _disk(row: dict[str, Any] | None) -> str:
    return f"{row['disk_bytes'] / MiB:,.1f}" if row and row.get("disk_bytes") is not None else ""


def _table(rows: list[dict[str, Any]], model: str, methods: tuple[str, ...], cell: Any) -> list[str]:
    at = {(r["world_size"], r["method"]): r for r in rows if r["model"] == model}
    sizes = sorted({w for w, _ in at})
    lines = ["| method | " + " | ".join(f"W={w}" for w in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for method in methods:
        cells = [at.get((w, method)) for w in sizes]
        if any(cells) and any(cell(c) for c in cells):
            lines.append(f"| {LABELS[method]} | " + " | ".join(cell(c) for c in cells) + " |")
    return lines + [""]


def _verdict_line(v: dict[str, Any]) -> str:
    met = "MET " if v["met"] else "MISS" if v["met"] is False else "n/a "
    value = f"{v['value']:.2f}" if v["value"] is not None else "-"
    return f"{met} {v['target']:<50} {v['model']:>5} W={v['world_size']}  {value:>6} (limit {v['limit']})  {v['detail']}"


def console(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':>6} {'W':>2} {'method':<18} {'median ms':>10} {'spread':>7} {'x floor':>8} {'x dcp':>6} "
             f"{'durable':>9} {'rss0 MiB':>9} {'rss1 MiB':>9} {'disk MiB':>9}  note"]
    for r in rows:
        if "na" in r:
            lines.append(f"{r['model']:>6} {r['world_size']:>2} {r['method']:<18} n/a: {r['na']}")
            continue
        fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else ""  # noqa: E731
        extra = f"{r['overhead_s'] * 1e3:+.0f} ms/ckpt" if r.get("overhead_s") is not None else ""
        lines.append(
            f"{r['model']:>6} {r['world_size']:>2} {r['method']:<18} {r['median_s'] * 1e3:>10.1f} {spread(r):>7.0%} "
            f"{fmt('x_floor', '.2f'):>8} {fmt('x_dcp', '.2f'):>6} "
            f"{(format(r['durable_median_s'] * 1e3, '.0f') + 'ms') if r.get('durable_median_s') else '':>9} "
            f"{r['rss_recipient'] / MiB:>9.1f} {(format(r['rss_other'] / MiB, '.1f') if r.get('rss_other') is not None else ''):>9} "
            f"{(format(r['disk_bytes'] / MiB, '.1f') if r.get('disk_bytes') is not None else ''):>9}  {extra} {r.get('note', '')}"
        )
    return "\n".join(lines)


def verdicts_text(rows: list[dict[str, Any]]) -> str:
    return "\n".join(_verdict_line(v) for v in targets(rows))


def _train_line(meta: dict[str, Any]) -> str:
    t = meta.get("train")
    if not t:
        return "Training runs: not measured."
    skipped = f"; skipped for time: {', '.join(meta['train_skipped'])}" if meta.get("train_skipped") else ""
    return (f"Training runs: {t['steps']} Adam steps with a checkpoint after every {t['every']} ({t['checkpoints']} per run, "
            f"the last one waited for), {t['repeats']} runs per variant, variants interleaved{skipped}.")


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], png_name: str | None) -> str:
    lines = [
        f"# Checkpoint benchmark ({meta['finished']})",
        "",
        f"Machine: {meta['machine']}. Backend: {meta['backend']}. {meta['versions']}.",
        f"Command: `{meta['command']}`; wall time {meta['wall_s'] / 60:.1f} min; load average before/after: "
        f"{meta['load_before']} / {meta['load_after']}. Checkpoints written to {meta['storage']}.",
        f"Package measured: {meta['package']}.",
        _train_line(meta),
        f"Optimizer state only, for both ours and DCP (Adam after {meta['steps']} steps; one FSDP unit per block plus "
        "the root; ours on fairscale FSDP, DCP on FSDP2 `fully_shard`, same model and batches).",
        f"Each latency: median of {meta['repeats']} barrier-synchronised calls after {meta['warmup']} warm-up round(s), "
        "methods interleaved round-robin, slowest rank per call. `x fl`: ratio to the floor of the same operation; "
        "`x dcp`: ratio to DCP's counterpart. ⚠ WRONG: the result differs from the saved state; †: see notes.",
        "",
    ]
    verdicts = targets(rows)
    if verdicts:
        lines += ["## Targets", "", "| target | model | W | value | limit | met | detail |", "|---|---|---|---|---|---|---|"]
        for v in verdicts:
            met = "yes" if v["met"] else "**no**" if v["met"] is False else "n/a"
            value = f"{v['value']:.2f}" if v["value"] is not None else "-"
            lines.append(f"| {v['target']} | {v['model']} | {v['world_size']} | {value} | {v['limit']} | {met} | {v['detail']} |")
        lines.append("")
    bad = wrong_results(rows)
    lines += [f"Correctness: {len(bad)} wrong or unchecked result(s) out of {sum('na' not in r for r in rows)}.", ""]
    latency = tuple(m for m in ORDER if m not in TRAIN)
    for model in dict.fromkeys(r["model"] for r in rows):
        full = next(r["full_bytes"] for r in rows if r["model"] == model)
        pairs = sorted({(r["world_size"], r["other_world_size"], r["reshard_to"]) for r in rows if r["model"] == model})
        where = "; ".join(f"W={w}: other W {o}, reshard to {m}" for w, o, m in pairs)
        lines += [f"## {model} model (full Adam state {full / MiB:,.0f} MiB)", "", f"Other world sizes: {where}.", ""]
        lines += ["Latency, ms:", ""] + _table(rows, model, latency, _latency)
        lines += ["Training run with a checkpoint every N steps (median; overhead per checkpoint against the same "
                  "round's run without, [min..max] over rounds):", ""] + _table(rows, model, TRAIN, _training)
        lines += ["Peak RSS growth, rank 0 / rank 1, MiB:", ""] + _table(rows, model, ORDER, _rss)
        lines += ["Bytes on disk, MiB (all ranks' files):", ""] + _table(rows, model, latency, _disk)
    notes = sorted({(r["method"], r.get("na") or r.get("note")) for r in rows if r.get("na") or r.get("note")})
    if notes:
        lines += ["## Notes", ""]
        for method, text in notes:
            where = ", ".join(f"{r['model']} W={r['world_size']}" for r in rows
                              if r["method"] == method and (r.get("na") or r.get("note")) == text)
            lines.append(f"- {LABELS.get(method, method)}: {text} ({where})")
        lines.append("")
    if png_name:
        lines += [f"![checkpoint latency against world size]({png_name})", ""]
    return "\n".join(lines)


OURS, DCP, FLOOR = "C0", "C1", "k"
# panel title -> series (method, value key, colour, line style, label suffix)
PANELS: dict[str, tuple[tuple[str, str, str, str, str], ...]] = {
    "save, ms": (
        ("ours_save", "median_s", OURS, "o-", ""),
        ("ours_async", "median_s", OURS, "o--", ""),
        ("ours_async", "durable_median_s", OURS, ":", " until durable"),
        ("dcp_save", "median_s", DCP, "s-", ""),
        ("dcp_async", "median_s", DCP, "s--", ""),
        ("dcp_async", "durable_median_s", DCP, ":", " until durable"),
        ("floor_save", "median_s", FLOOR, "--", ""),
    ),
    "load, ms": (
        ("ours_load_same", "median_s", OURS, "o-", ""),
        ("ours_load_other", "median_s", OURS, "o--", ""),
        ("dcp_load_same", "median_s", DCP, "s-", ""),
        ("dcp_load_other", "median_s", DCP, "s--", ""),
        ("floor_load", "median_s", FLOOR, "--", ""),
    ),
    "offline, ms": (
        ("ours_consolidate", "median_s", OURS, "o-", ""),
        ("dcp_to_torch_save", "median_s", DCP, "s-", ""),
        ("floor_consolidate", "median_s", FLOOR, "--", ""),
        ("ours_reshard", "median_s", "C2", "o-", ""),
        ("floor_reshard", "median_s", "C2", ":", ""),
    ),
    "training overhead per checkpoint, ms": (
        ("train_ours_sync", "overhead_s", OURS, "o-", ""),
        ("train_ours_async", "overhead_s", OURS, "o--", ""),
        ("train_dcp_sync", "overhead_s", DCP, "s-", ""),
        ("train_dcp_async", "overhead_s", DCP, "s--", ""),
    ),
}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), len(PANELS), figsize=(4.4 * len(PANELS), 3.8 * len(models) + 0.6), squeeze=False)
    for ax_row, model in zip(axes, models):
        for ax, (panel, series) in zip(ax_row, PANELS.items()):
            for method, key, colour, style, suffix in series:
                pts = sorted((r["world_size"], r[key] * 1e3) for r in rows
                             if r["model"] == model and r["method"] == method and r.get(key) is not None)
                if pts:
                    ax.plot(*zip(*pts), style, color=colour, label=LABELS[method].split(",")[0] + suffix if suffix else LABELS[method], markersize=4,
                            linewidth=2 if colour == OURS else 1.2)
            ax.set_title(f"{model}: {panel}", fontsize=9)
            ax.set_xlabel("world size")
            ax.set_xticks(sorted({r["world_size"] for r in rows if r["model"] == model}))
            ax.set_ylim(bottom=min(0, ax.get_ylim()[0]))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path, name: str) -> dict[str, Path]:
    return write_files(rows, meta, out_dir, name, plot=plot, markdown=markdown, targets=targets)
