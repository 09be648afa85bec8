"""The index of ``benchmarks/results/``: one row per result (the files sharing a stem), its benchmark, the date and
command its header names, and its targets' verdicts counted from its JSON; written to ``results/README.md`` by
``python -m benchmarks report``. Reads only the files (no torch)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .registry import RESULTS, RETIRED, owner, results_files

DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}(?: \d{2}:\d{2})?\b")
COMMAND = re.compile(r"`(python -m benchmarks[^`]*)`")
HEADER_LINES = 8  # where a page's title, machine and command lines are


@dataclass(frozen=True)
class Entry:
    """One result: ``stem`` (path under ``results/`` without the suffix) and the suffixes present."""

    benchmark: str
    stem: str
    suffixes: tuple[str, ...]
    date: str
    command: str
    verdicts: str


def count_verdicts(targets: Any) -> str:
    """``"N PASS, M MISS[, K other]"`` from a JSON's ``targets``: rows with ``met`` (True, False or None), rows with a
    ``verdict`` word, or a mapping of target to bool; ``""`` when there are none."""
    if isinstance(targets, dict):
        outcomes = ["PASS" if v is True else "MISS" if v is False else "other" for v in targets.values()]
    elif isinstance(targets, list) and targets and all(isinstance(t, dict) for t in targets):
        outcomes = [_outcome(t) for t in targets]
    else:
        return ""
    counts = {word: outcomes.count(word) for word in ("PASS", "MISS", "other")}
    return ", ".join(f"{n} {word}" for word, n in counts.items() if n or word != "other")


def _outcome(target: dict[str, Any]) -> str:
    if "met" in target:
        return {True: "PASS", False: "MISS"}.get(target["met"], "other")
    word = str(target.get("verdict", "")).strip("*").upper()
    return word if word in ("PASS", "MISS") else "other"


def _header(stem: Path, suffixes: tuple[str, ...]) -> tuple[str, str, Any]:
    """(date, command, JSON targets) from the page's first lines, else from the JSON's ``meta``."""
    head = "\n".join(stem.with_suffix(".md").read_text().splitlines()[:HEADER_LINES]) if ".md" in suffixes else ""
    data = json.loads(stem.with_suffix(".json").read_text()) if ".json" in suffixes else {}
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    date, command = DATE.search(head), COMMAND.search(head)
    return (
        date[0] if date else str(meta.get("date", "")),
        command[1] if command else str(meta.get("command", "")),
        data.get("targets") if isinstance(data, dict) else None,
    )


def entries(root: Path = RESULTS) -> list[Entry]:
    """Every result under ``root``, in file order."""
    stems: dict[str, list[str]] = {}
    for relative in results_files(root):
        stem, dot, suffix = relative.rpartition(".")
        stems.setdefault(stem if dot else relative, []).append(f".{suffix}" if dot else "")
    out = []
    for stem, suffixes in stems.items():
        bench = owner(f"{stem}{suffixes[0]}")
        name = bench.name if bench else ("retired" if f"{stem}{suffixes[0]}" in RETIRED else "none")
        date, command, targets = _header(root / stem, tuple(suffixes))
        out.append(Entry(name, stem, tuple(suffixes), date, command, count_verdicts(targets)))
    return out


def markdown(rows: list[Entry]) -> str:
    """The index page."""
    lines = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks report` from the files here (do not edit by hand); `python -m benchmarks list`",
        "names each benchmark, what it measures and its commands. Date and command: from each page's header; targets:",
        "its JSON's verdicts (- where it records none).",
        "",
        "| benchmark | result | files | date | command | targets |",
        "|---|---|---|---|---|---|",
    ]
    for e in rows:
        files = ", ".join(f"[{s}]({e.stem}{s})" for s in e.suffixes)
        command = f"`{e.command}`" if e.command else "-"
        lines.append(f"| {e.benchmark} | {e.stem} | {files} | {e.date or '-'} | {command} | {e.verdicts or '-'} |")
    return "\n".join(lines) + "\n"


def write(root: Path = RESULTS) -> Path:
    """Write ``root/README.md``; its path."""
    path = root / "README.md"
    path.write_text(markdown(entries(root)))
    return path
