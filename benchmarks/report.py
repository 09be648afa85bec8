"""One report module for every benchmark: the run's header, rows with ratios, target verdicts, tables, notes,
a plot, and the ``.md`` / ``.json`` / ``.png`` files. A benchmark keeps only what is its own (its labels, its
targets, its cells); everything that reads alike across benchmarks is here, once.

A benchmark's main (see ``benchmarks/whole_state.py`` for a whole one)::

    run = Run("python -m benchmarks.gpu", argv)          # meta: command, machine, versions, package, load
    run.meta |= {"repeats": 5}                             # the benchmark's own header fields
    run.log("W=2 ...")                                     # "[   12s] W=2 ..."
    rows = [record(model, 2, full_bytes, method, value, results.get(floor)) for method, value in results.items()]
    run.close(suite, rows, out_dir, "mine")                # finish; write json, md (and png); print console, verdicts

``suite`` is the benchmark's report module, with its ``targets``, ``markdown``, ``console`` and optional ``plot``
(``write`` writes the files of any other). ``results`` is what ``measure.measure`` returns (``Measurement`` or ``NotAvailable`` per method); ``compared``
also adds the ratio to DCP's counterpart and an async save's time until durable. The targets::

    def targets(rows):                                     # (name, method, versus "floor" | "dcp", limit)
        return check_targets(rows, [("save <= 1.1x floor", "mine_save", "floor", 1.1)], FLOOR_OF, DCP_OF)

The markdown, a function of the rows and meta alone, so that a stored JSON re-renders its stored ``.md``
(``tests/test_benchmarks_tree.py`` checks that it does)::

    def markdown(rows, meta, png_name):
        rep = Report("My benchmark", meta)                 # "# My benchmark (finished)", "", "Machine: ..."
        rep.add(f"Command: `{meta['command']}`.", "")      # any lines
        rep.targets(targets(rows), "## Targets")           # the verdict table (nothing when there are none)
        rep.by_world_size(rows, "5M", METHODS, cell, LABELS)  # a method per line, a world size per column
        rep.table(["method", "W=2"], [["ours", "12"]])     # any Markdown table, then a blank line
        return rep.notes(rows, LABELS).image(png_name, "latency").text()

``lines(path, title, [[panel, ...], ...])`` draws line panels (``{"title", "series": [(label, [(x, y)], style,
colour, width)], ...}``) and returns False without matplotlib. Helpers for cells: ``ms``, ``fmt``, ``mark``,
``spread``; for groups of rows: ``index``, ``groups``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .host import load_average, machine, package
from .measure import Measurement, NotAvailable
from .peak import MiB
from .registry import RESULTS as RESULTS  # where results go (re-exported): benchmarks/registry.py
from .registry import SCRATCH as SCRATCH

Row = dict[str, Any]

# ---------------------------------------------------------------------------------------------------
# The run: its header fields (meta) and its log


class Run:
    """One benchmark run: ``meta`` (the header every report starts with), a timed log, and its end."""

    def __init__(self, prog: str, argv: Sequence[str], *, backend: str = "gloo", versions: str = "") -> None:
        import fairscale
        import torch

        self.started = time.perf_counter()
        self.meta: dict[str, Any] = {
            "command": f"{prog} {shlex.join(argv)}".strip(),
            "machine": machine(),
            "cores": os.cpu_count(),
            "backend": backend,
            "versions": f"torch {torch.__version__}, fairscale {fairscale.__version__}, Python {platform.python_version()}"
            + (f", {versions}" if versions else ""),
            "package": package(),
            "load_before": load_average(),
        }

    def log(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.0f}s] {text}", flush=True)

    def finish(self) -> dict[str, Any]:
        self.meta["wall_s"] = time.perf_counter() - self.started
        self.meta["load_after"] = load_average()
        self.meta["finished"] = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        return self.meta

    def close(self, suite: Any, rows: list[Row], out_dir: Path, name: str, value: str = ".2f") -> None:
        """Finish, write ``suite``'s files (its ``targets``, ``markdown`` and ``plot`` if any), print its ``console`` table
        and the verdicts."""
        meta, verdicts = self.finish(), suite.targets(rows)
        paths = write(out_dir, name, rows=rows, meta=meta, targets=verdicts, markdown=suite.markdown, plot=getattr(suite, "plot", None))
        self.done(paths, suite.console(rows), verdict_lines(verdicts, value))

    def done(self, paths: dict[str, Path], *texts: str) -> None:
        """Print the run's closing texts (tables, verdicts) and what it wrote."""
        for text in texts:
            print(f"\n{text}")
        print(f"\nwall time {self.meta['wall_s'] / 60:.1f} min; wrote " + ", ".join(str(p) for p in paths.values()))


# ---------------------------------------------------------------------------------------------------
# Rows


def record(model: str, world_size: int, full_bytes: int, method: str, value: Any, base: Any) -> Row:
    """One row of the JSON: the measurement and its ratios to ``base`` (the floor it is compared with)."""
    row: Row = {"model": model, "world_size": world_size, "method": method, "full_bytes": full_bytes}
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


def compared(
    model: str, world_size: int, full_bytes: int, results: dict[str, Any], *, order: Sequence[str], floor_of: dict[str, str], dcp_of: dict[str, str]
) -> list[tuple[Row, Any]]:
    """Rows in ``order`` with their floor ratio (``record``), their ratio to DCP's counterpart (``x_dcp``) and the
    median time until durable of an async save (``durable_median_s``); each with its measurement."""
    out = []
    for method in sorted(results, key=lambda m: order.index(m) if m in order else len(order)):
        value = results[method]
        row = record(model, world_size, full_bytes, method, value, results.get(floor_of.get(method, "")))
        peer = results.get(dcp_of.get(method, ""))
        if isinstance(value, Measurement) and isinstance(peer, Measurement):
            row["x_dcp"] = value.median_s / peer.median_s
        if isinstance(value, Measurement) and value.extra.get("durable_s"):
            row["durable_median_s"] = statistics.median(value.extra["durable_s"])
        out.append((row, value))
    return out


def index(rows: Iterable[Row]) -> dict[tuple[str, int, str], Row]:
    return {(r["model"], r["world_size"], r["method"]): r for r in rows}


def groups(rows: Iterable[Row]) -> list[tuple[str, int]]:
    """The (model, world size) pairs of the rows, in order."""
    return list(dict.fromkeys((r["model"], r["world_size"]) for r in rows))


def spread(row: Row) -> float:
    """Relative spread of the timed calls (max-min over median), for noise judgement."""
    times = row.get("times_s") or []
    return (max(times) - min(times)) / statistics.median(times) if times else 0.0


def ms(seconds: float) -> str:
    """Milliseconds: whole with thousands separators, two decimals under 10 ms."""
    return f"{seconds * 1e3:,.0f}" if abs(seconds) >= 0.01 else f"{seconds * 1e3:.2f}"


def mark(row: Row, wrong: str = " ⚠ WRONG") -> str:
    note = row.get("note") or ""
    return wrong if note.startswith("wrong output") else " †" if note else ""


def is_wrong(row: Row | None) -> bool:
    return bool(row) and (row.get("note") or "").startswith(("wrong output", "result not checked"))  # type: ignore[union-attr]


def fmt(row: Row, key: str, spec: str, scale: float = 1.0) -> str:
    return format(row[key] / scale, spec) if row.get(key) is not None else ""


# ---------------------------------------------------------------------------------------------------
# Verdicts


def verdict(target: str, model: str, world_size: int, value: float | None, limit: Any, met: bool | None, detail: str) -> Row:
    return {"target": target, "model": model, "world_size": world_size, "value": value, "limit": limit, "met": met, "detail": detail}


def against(row: Row | None, base: Row | None, key: str, limit: float | None) -> tuple[float | None, bool | None, str]:
    """``row[key]`` (a ratio to ``base``) against ``limit``: (value, met, detail); None where not measured."""
    if row is None:
        return None, None, "not run here"
    if "na" in row:
        return None, None, row["na"]
    if is_wrong(row):
        return None, False, row["note"]
    value = row.get(key)
    if value is None or base is None:
        return None, None, "no comparison measured"
    detail = f"{row['median_s'] * 1e3:,.0f} ms vs {base['median_s'] * 1e3:,.0f} ms"
    return value, None if limit is None else value <= limit, detail


def check_targets(rows: list[Row], targets: Iterable[tuple[str, str, str, float | None]], floor_of: dict[str, str], dcp_of: dict[str, str], *,
                  special: dict[str, Callable[[Row, Any], tuple[float | None, bool | None, str]]] | None = None, skip_missing: bool = False) -> list[Row]:  # fmt: skip
    """One verdict per (target, model, world size): ``targets`` are ``(name, method, versus, limit)`` where ``versus``
    is "floor" or "dcp" (the row's ratio to it, ``against``) or a key of ``special`` (its own check of a measured
    row); ``skip_missing`` leaves out the targets of methods not run in a group."""
    at, out = index(rows), []
    for model, ws in groups(rows):
        for name, method, versus, limit in targets:
            row = at.get((model, ws, method))
            if row is None and skip_missing:
                continue
            if special and versus in special and row and "na" not in row and not is_wrong(row):
                value, met, detail = special[versus](row, limit)
            else:
                base = at.get((model, ws, (dcp_of if versus == "dcp" else floor_of).get(method, "")))
                value, met, detail = against(row, base, "x_dcp" if versus == "dcp" else "x_floor", limit)
            out.append(verdict(name, model, ws, value, limit, met, detail))
    return out


def verdict_word(v: Row, words: tuple[str, str, str, str] = ("PASS", "MISS", "info", "n/a")) -> str:
    """met / missed / a value without a limit / not measured."""
    return words[0] if v["met"] else words[1] if v["met"] is False else words[2] if v["value"] is not None else words[3]


def verdict_lines(verdicts: Iterable[Row], value: str = ".2f") -> str:
    """The verdicts for the console, one a line."""
    return "\n".join(
        f"{verdict_word(v):<4} {v['target']:<50} {v['model']:>5} W={v['world_size']}  "
        f"{format(v['value'], value) if v['value'] is not None else '-':>7} (limit {v['limit']})  {v['detail']}"
        for v in verdicts
    )


# ---------------------------------------------------------------------------------------------------
# Markdown


def table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(r) + " |" for r in rows]


class Report:
    """A Markdown page built line by line; see the module docstring."""

    def __init__(self, title: str, meta: dict[str, Any]) -> None:
        self.lines = [f"# {title} ({meta['finished']})", "", f"Machine: {meta['machine']}. Backend: {meta['backend']}. {meta['versions']}."]

    def add(self, *lines: str) -> Report:
        self.lines += lines
        return self

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[str]], blank: bool = True) -> Report:
        self.lines += table(columns, rows) + ([""] if blank else [])
        return self

    def by_world_size(self, rows: list[Row], model: str, methods: Iterable[str], cell: Callable[[Row | None], str], labels: dict[str, str], sizes: Sequence[int] | None = None) -> Report:
        """One line per method that has a cell, one column per world size."""
        at = {(r["world_size"], r["method"]): r for r in rows if r["model"] == model}
        sizes = sizes or sorted({w for w, _ in at})
        body = []
        for method in methods:
            cells = [at.get((w, method)) for w in sizes]
            if any(cells) and any(cell(c) for c in cells):
                body.append([labels.get(method, method)] + [cell(c) for c in cells])
        return self.table(["method"] + [f"W={w}" for w in sizes], body)

    def targets(self, verdicts: list[Row], heading: str, *, words: tuple[str, str, str, str] = ("PASS", "**MISS**", "info", "n/a"), column: str = "verdict", value: str = ".2f", limit: Callable[[Row], str] | None = None) -> Report:
        """The verdict table under ``heading``; nothing where there are no verdicts."""
        if not verdicts:
            return self
        limit = limit or (lambda v: "-" if v["limit"] is None else f"{v['limit']}")
        body = [
            [v["target"], v["model"], str(v["world_size"]), "-" if v["value"] is None else format(v["value"], value), limit(v), verdict_word(v, words), v["detail"]]
            for v in verdicts
        ]
        return self.add(heading, "").table(["target", "model", "W", "value", "limit", column, "detail"], body)

    def notes(self, rows: list[Row], labels: dict[str, str]) -> Report:
        """One line per distinct (method, note or reason), naming where it was seen."""
        notes = sorted({(r["method"], r.get("na") or r.get("note")) for r in rows if r.get("na") or r.get("note")})
        if notes:
            self.add("## Notes", "")
            for method, text in notes:
                where = ", ".join(f"{r['model']} W={r['world_size']}" for r in rows if r["method"] == method and (r.get("na") or r.get("note")) == text)
                self.add(f"- {labels.get(method, method)}: {text} ({where})")
            self.add("")
        return self

    def image(self, png_name: str | None, alt: str) -> Report:
        return self.add(f"![{alt}]({png_name})", "") if png_name else self

    def text(self) -> str:
        return "\n".join(self.lines)


def console(rows: Iterable[Sequence[str]], widths: Sequence[int]) -> str:
    """Rows of cells as fixed-width columns, for the terminal."""
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# Columns of ``measurements``: (heading, width, cell of a measured row)
MEASURED: list[tuple[str, int, Callable[[Row], str]]] = [
    ("median ms", 10, lambda r: f"{r['median_s'] * 1e3:.1f}"),
    ("spread", 7, lambda r: f"{spread(r):.0%}"),
    ("x floor", 8, lambda r: fmt(r, "x_floor", ".2f")),
]
RSS: list[tuple[str, int, Callable[[Row], str]]] = [
    ("rss0 MiB", 9, lambda r: f"{r['rss_recipient'] / MiB:.1f}"),
    ("rss1 MiB", 9, lambda r: fmt(r, "rss_other", ".1f", MiB)),
]


def measurements(rows: Iterable[Row], columns: Sequence[tuple[str, int, Callable[[Row], str]]], method_width: int = 18) -> str:
    """One line per row for the terminal: model, W, method, then ``columns`` (a row not measured: its reason)."""
    head = ["model", "W", "method", *(c[0] for c in columns)]
    lines = [[r["model"], str(r["world_size"]), r["method"], *(f"n/a: {r['na']}",)] if "na" in r else
             [r["model"], str(r["world_size"]), r["method"], *(c[2](r) for c in columns)] for r in rows]  # fmt: skip
    return console([head, *lines], (6, 2, method_width, *(c[1] for c in columns)))


def by_group(rows: list[Row], head: Sequence[str], line: Callable[[Row], list[str]], widths: Sequence[int]) -> str:
    """``console`` of the rows, one block per (model, world size) under a ``-- model, W=w`` line."""
    return "\n".join(f"-- {m}, W={w}\n" + console([head] + [line(r) for r in rows if (r["model"], r["world_size"]) == (m, w)], widths) for m, w in groups(rows))


# ---------------------------------------------------------------------------------------------------
# Plot and files


def lines(path: Path, title: str, panels: list[list[dict[str, Any]]], *, size: tuple[float, float] = (4.4, 3.8), dpi: int = 110, legend: str = "each") -> bool:
    """Line panels (a grid: a list of rows of panels) into a PNG; False without matplotlib.

    A panel: ``{"title", "series": [(label, [(x, y), ...], style, colour, width)], "xlabel", "ylabel",
    "xticks", "xscale", "yscale", "hline": (y, label)}``, any but ``series`` optional. ``legend="shared"``
    puts one legend under the grid (from the first panel) instead of one per panel.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return False
    ncols = max(len(r) for r in panels)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(size[0] * ncols + 0.6, size[1] * len(panels) + 0.6), squeeze=False)
    for ax_row, row in zip(axes, panels):
        for ax, panel in zip(ax_row, row + [None] * (ncols - len(row))):
            if not panel or not any(s[1] for s in panel["series"]):
                ax.axis("off")
                continue
            for label, points, style, colour, width in (s for s in panel["series"] if s[1]):
                ax.plot(*zip(*sorted(points)), style, color=colour, linewidth=width, label=label, markersize=4)
            if panel.get("hline"):
                ax.axhline(panel["hline"][0], color="grey", ls=":", label=panel["hline"][1])
            ax.set(xscale=panel.get("xscale", "linear"), yscale=panel.get("yscale", "linear"), title=panel.get("title", ""))
            ax.set_xlabel(panel.get("xlabel", "world size"))
            ax.set_ylabel(panel.get("ylabel", ""))
            ticks = sorted({x for s in panel["series"] for x, _ in s[1]})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(True, which="both", alpha=0.3)
            if legend == "each":
                ax.legend(fontsize=6)
    if legend == "shared":
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0.12 if legend == "shared" else 0, 1, 0.96))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def write(
    out_dir: Path,
    name: str,
    *,
    rows: list[Row],
    meta: dict[str, Any],
    targets: list[Row],
    markdown: Callable[[list[Row], dict[str, Any], str | None], str],
    plot: Callable[[list[Row], Path, str], bool] | None = None,
) -> dict[str, Path]:
    """``<name>.json``, ``<name>.png`` (when ``plot`` draws one; a plot that fails is reported and skipped) and
    ``<name>.md``, which links the plot; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md", "png": out_dir / f"{name}.png"}
    paths["json"].write_text(json.dumps({"meta": meta, "targets": targets, "rows": rows}, indent=1, default=str))  # first: what a run measured
    try:  # a plot that fails must not lose the run's tables
        has_png = plot is not None and plot(rows, paths["png"], f"{meta['machine']}\n{meta['backend']}, {meta['finished']}")
    except Exception as exc:
        print(f"no plot written: {type(exc).__name__}: {exc}")
        has_png = False
    paths["md"].write_text(markdown(rows, meta, paths["png"].name if has_png else None))
    if not has_png:
        paths.pop("png")
    return paths
