"""The benchmarks import what exists: every ``from .x import a`` / ``from . import x`` in ``benchmarks/`` names a
module of the folder and names it defines, and no benchmark imports a package module that is not there.
Checked on the source (no benchmark is run or imported: they need the ``bench`` extra; the package's modules are)."""

from __future__ import annotations

import ast
import importlib.util
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
