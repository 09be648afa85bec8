"""The benchmarks import what exists: every ``from .x import a`` / ``from . import x`` in ``benchmarks/`` names a
module of the folder and names it defines, and no benchmark imports a package module that is not there (checked on
the source: the benchmarks need the ``bench`` extra). Their report code is written once: the shared helpers of
``benchmarks/report.py`` are defined nowhere else, each report module re-renders the committed ``results/*.md``
from the committed ``results/*.json`` (these import only torch), and the profiler's categories name modules that
exist."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FILES = sorted(BENCH.rglob("*.py"))


def _module_file(package: Path, dotted: str) -> Path | None:
    target = package.joinpath(*dotted.split(".")) if dotted else package
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _defined(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(BENCH)))
def test_benchmark_imports_resolve(path: Path) -> None:
    problems = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            package = path.parent
            for _ in range(node.level - 1):
                package = package.parent
            module = _module_file(package, node.module or "")
            for alias in node.names:
                if node.module is None:  # from . import x: x is a module of the folder
                    if _module_file(package, alias.name) is None:
                        problems.append(f"line {node.lineno}: no module {alias.name} in {package.name}/")
                elif module is None:
                    problems.append(f"line {node.lineno}: no module .{node.module}")
                elif alias.name not in _defined(module) and not (
                    module.name == "__init__.py" and _module_file(module.parent, alias.name) is not None
                ):  # a name it defines, or a submodule of a package
                    problems.append(f"line {node.lineno}: .{node.module} defines no {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdp_optim":
            if importlib.util.find_spec(node.module) is None:
                problems.append(f"line {node.lineno}: no module {node.module}")
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
    assert not problems, f"{path.relative_to(ROOT)}: {problems}"


# Names a benchmark's own report module defines for its main (its table on the console, its files).
HOOKS = {"console", "write"}


def _top_level(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_report_helpers_are_defined_once() -> None:
    shared = _top_level(BENCH / "report.py") - HOOKS
    assert {"Report", "Run", "record", "verdict", "table", "lines", "spread"} <= shared, f"benchmarks/report.py lost helpers: {sorted(shared)}"
    again = {str(p.relative_to(BENCH)): sorted(_top_level(p) & shared) for p in FILES if p.name != "report.py" or p.parent != BENCH}
    assert not {k: v for k, v in again.items() if v}, f"helpers of benchmarks/report.py defined again: {again}"


# (report module, stored result, the plot name its page links, or None)
STORED = [
    ("benchmarks.gather.report", "latest", "latest.png"),
    ("benchmarks.ckpt.report", "checkpoint_latest", "checkpoint_latest.png"),
    ("benchmarks.ckpt.report", "checkpoint_100M_format3", "checkpoint_100M_format3.png"),
    ("benchmarks.ckpt.report", "checkpoint_100M_train", "checkpoint_100M_train.png"),
    ("benchmarks.ckpt.report", "checkpoint_100M_format2", "ckpt100M.png"),
    ("benchmarks.whole.report", "whole_state", None),
    ("benchmarks.storage.report", "storage", None),
    ("benchmarks.gpu.report", "gpu_staging_small", None),
]


@pytest.mark.parametrize(("module", "name", "png"), STORED, ids=[s[1] for s in STORED])
def test_report_renders_the_stored_result(module: str, name: str, png: str | None) -> None:
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))  # fairscale's wheel installs a top-level ``benchmarks`` too
    mod = importlib.import_module(module)
    assert Path(mod.__file__).is_relative_to(BENCH), f"{module} imported from {mod.__file__}, not {BENCH}"
    stored = json.loads((BENCH / "results" / f"{name}.json").read_text())
    assert mod.targets(stored["rows"]) == stored["targets"], f"{module}.targets differs from results/{name}.json's"
    rendered = mod.markdown(stored["rows"], stored["meta"], png).splitlines()
    expected = (BENCH / "results" / f"{name}.md").read_text().splitlines()
    diff = [(k + 1, e, r) for k, (e, r) in enumerate(zip(expected, rendered)) if e != r]
    assert rendered == expected, f"{module}.markdown differs from results/{name}.md: {len(rendered)} vs {len(expected)} lines, first (line, stored, rendered): {diff[:2]}"


@pytest.mark.parametrize("folder", ["results", "results/jobs32"])
def test_scale_tables_render_the_stored_result(folder: str) -> None:
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))
    from benchmarks.scale.report import tables

    stored = json.loads((BENCH / folder / "scale.json").read_text())
    assert tables(stored) + "\n" == (BENCH / folder / "scale.md").read_text(), f"benchmarks/scale/report.py's tables differ from {folder}/scale.md"


def test_memory_tier_report_renders_the_stored_result() -> None:
    """The stored page is the rendered one followed by notes written by hand."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))
    from benchmarks.memory_tier import _report

    stored = (BENCH / "results" / "memory_tier.md").read_text()
    command = re.search(r"Command: `([^`]*)`", stored)
    assert command, "results/memory_tier.md names no command"
    rendered = _report(json.loads((BENCH / "results" / "memory_tier.json").read_text()), command[1])
    assert stored.startswith(rendered), "benchmarks/memory_tier.py's report differs from the start of results/memory_tier.md"


def test_profile_categories_name_existing_modules() -> None:
    source = (BENCH / "ckpt" / "profile.py").read_text()
    named = re.findall(r'"(fsdp_optim/[\w/]+\.py)"', source)
    assert named, "benchmarks/ckpt/profile.py names no fsdp_optim module: the categories were not found"
    missing = [p for p in named if not (ROOT / p).is_file()]
    assert not missing, f"benchmarks/ckpt/profile.py counts time in modules that do not exist: {missing}"


def _data_lines(path: Path) -> set[int]:
    """Lines of module-level constants that hold literal data (label and target tables, records of literals such as
    ``registry.BENCHMARKS``), not code."""
    lines: set[int] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if all(isinstance(n, (ast.Constant, ast.Tuple, ast.List, ast.Dict, ast.Name, ast.Load, ast.UnaryOp, ast.USub, ast.Call, ast.keyword)) for n in ast.walk(node.value)):
                lines.update(range(node.lineno, node.end_lineno + 1))  # type: ignore[operator]
    return lines


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the duplicates command is not installed here")
def test_no_copied_code_in_benchmarks() -> None:
    """Pairs of places sharing six lines or more, but for literal data tables alike in shape (each benchmark's targets)."""
    out = subprocess.run(["duplicates", "--repo", str(BENCH), "--seconds", "120", "--most", "50"], capture_output=True, text=True, check=False).stdout
    assert "incomplete" not in out, f"duplicates did not read all of benchmarks/:\n{out}"
    copied = []
    for row in re.findall(r"^D\d+ (\S+):(\d+)-(\d+) ~ (\S+):(\d+)-(\d+)", out, flags=re.M):
        sides = [(BENCH / row[k], range(int(row[k + 1]), int(row[k + 2]) + 1)) for k in (0, 3)]
        if not all(set(span) <= _data_lines(path) for path, span in sides):
            copied.append(row)
    assert not copied, f"duplicates finds copied code in benchmarks/: {copied}\n{out}"


COMMAND = re.compile(r"python -m (benchmarks(?:\.\w+)+)(?: (\w+))?")


def test_documented_commands_exist() -> None:
    """Every ``python -m benchmarks.<name>`` in the docs, README, ARCHITECTURE.md, the CI scripts and the package's own
    text names a runnable module of benchmarks/, and each ``benchmarks.memory OPERATION`` an operation it has."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))
    from benchmarks.memory.__main__ import OPERATIONS

    texts = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md"), *(ROOT / ".ci").iterdir(), *(ROOT / "fsdp_optim").rglob("*.py")]
    problems = []
    for path in (p for p in texts if p.is_file()):
        for module, word in COMMAND.findall(path.read_text()):
            found = _module_file(ROOT, module)
            if found is None or (found.name == "__init__.py" and not (found.parent / "__main__.py").exists()):
                problems.append(f"{path.relative_to(ROOT)}: python -m {module}")
            elif module == "benchmarks.memory" and word not in (*OPERATIONS, "all"):
                problems.append(f"{path.relative_to(ROOT)}: python -m benchmarks.memory {word}")
    assert not problems, f"documented benchmark commands that do not exist: {problems}"
