"""Every reference to the package resolves: each dotted ``fsdp_optim.X.Y`` and each Sphinx-style
``:mod:``/``:func:``/``:class:``/``:data:``/``:meth:``/``:attr:``/``:exc:`` reference in the package's source
(docstrings, comments, messages), README.md and ARCHITECTURE.md names a real module or attribute; each file path
(``fsdp_optim/...py``, ``tests/...py``, ``benchmarks/...py``) and each benchmark module run with ``python -m`` named in the package,
docs/, tests/ and benchmarks/ exists.

Sphinx's rules: ``~`` only shortens the shown text; a reference starting with ``.`` is relative to the module's
package (``:mod:`.manifest``` in ``formats/sharded/reader.py`` is ``fsdp_optim.formats.sharded.manifest``); an
undotted one is a name of the module itself (or of the package's public API).
"""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_optim"
SOURCES = sorted(PACKAGE.rglob("*.py")) + [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
# Where file paths and benchmark modules are named too (their dotted package names are checked in SOURCES only).
TEXTS = SOURCES + sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "tests").glob("*.py")) + sorted(
    p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".md")
)
PATH = re.compile(r"(?<![\w/.])((?:fsdp_optim|tests|benchmarks)/[\w/]+\.py)\b")
RUN = re.compile(r"python -m (benchmarks(?:\.\w+)+)")
DOTTED = re.compile(r"(?<![\w.])fsdp_optim(?:\.[A-Za-z_]\w*)+")
SPHINX = re.compile(r":(mod|func|class|data|meth|attr|exc):`~?([\w.]+)(?:\(\))?`")
_MISSING = object()


def _module_name(path: Path) -> str | None:
    if path.suffix != ".py":
        return None
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(dotted: str) -> Any:
    """The object ``dotted`` names (the longest importable module, then attributes), or ``_MISSING``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr, _MISSING)
            if value is _MISSING:
                return _MISSING
        return value
    return _MISSING


def _candidates(ref: str, module: str | None) -> list[str]:
    if ref.startswith("."):
        package = module.rsplit(".", 1)[0] if module else "fsdp_optim"
        if module and (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists():
            package = module  # a package's own __init__: relative to itself
        return [package + ref, *([module + ref] if module else [])]
    found = [ref]
    if module:
        found.append(f"{module}.{ref}")
    found.append(f"fsdp_optim.{ref}")
    return found


def _tag(text: str, match: re.Match[str]) -> bool:
    """A quoted string that is exactly the name (a format tag such as ``"fsdp_optim.named_safetensors"``)."""
    before, after = text[match.start() - 1 : match.start()], text[match.end() : match.end() + 1]
    return before in "\"'" and before == after and before != ""


def _references() -> list[tuple[str, str, str | None]]:
    refs = []
    for path in SOURCES:
        text, module = path.read_text(), _module_name(path)
        where = str(path.relative_to(ROOT))
        refs += [(where, m.group(0).rstrip("."), None) for m in DOTTED.finditer(text) if not _tag(text, m)]
        refs += [(where, f":{m.group(1)}:{m.group(2)}", module) for m in SPHINX.finditer(text)]
    return sorted(set(refs), key=lambda r: (r[0], r[1]))


def _has(owner: Any, name: str) -> bool:
    """Whether a class has ``name``: an attribute, a dataclass field or an annotated member."""
    return hasattr(owner, name) or name in getattr(owner, "__dataclass_fields__", {}) or any(
        name in getattr(c, "__annotations__", {}) for c in getattr(owner, "__mro__", ()))


def _in_a_class(ref: str, module: str | None) -> bool:
    """Sphinx resolves ``:meth:`wait``` inside a class's docstring against that class: a member of a class of
    the module (or, dotted, ``Class.member`` of a class any module of the package defines)."""
    first, _, rest = ref.partition(".")
    if not rest and module:
        classes = [v for v in vars(importlib.import_module(module)).values() if isinstance(v, type)]
        return any(_has(c, first) for c in classes)
    owners = [getattr(importlib.import_module(m), first, None) for m in MODULES]
    return any(isinstance(o, type) and _has(o, rest) for o in owners) if rest and "." not in rest else False


def _resolves(ref: str, module: str | None) -> bool:
    """A module for ``:mod:``, anything for the other roles and a dotted name."""
    if ref.startswith(":mod:"):
        return any(isinstance(_resolve(c), types.ModuleType) for c in _candidates(ref.removeprefix(":mod:"), module))
    ref = re.sub(r"^:\w+:", "", ref)
    if module is None and ref.startswith("fsdp_optim."):
        return _resolve(ref) is not _MISSING
    return any(_resolve(c) is not _MISSING for c in _candidates(ref, module)) or _in_a_class(ref.lstrip("."), module)


MODULES = [m for m in map(_module_name, SOURCES) if m is not None and not m.endswith("__main__")]


def test_every_reference_resolves() -> None:
    broken = [f"{where}: {ref}" for where, ref, module in _references() if not _resolves(ref, module)]
    assert not broken, f"{len(broken)} references name nothing:\n" + "\n".join(broken)


def test_every_path_and_benchmark_named_exists() -> None:
    broken = []
    for path in TEXTS:
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        broken += [f"{where}: {m.group(1)}" for m in PATH.finditer(text) if not (ROOT / m.group(1)).exists()]
        broken += [f"{where}: python -m {m.group(1)}" for m in RUN.finditer(text)
                   if not (ROOT / Path(*m.group(1).split("."))).with_suffix(".py").exists()
                   and not (ROOT / Path(*m.group(1).split(".")) / "__main__.py").exists()]  # fmt: skip
    assert not broken, f"{len(broken)} paths name nothing:\n" + "\n".join(sorted(set(broken)))


def test_test_docstrings_say_what_they_check_not_which_issue_asked() -> None:
    import ast

    cited = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        for node in nodes:
            doc = ast.get_docstring(node) or ""
            if re.search(r"\bissues? #?\d+", doc, re.IGNORECASE):
                cited.append(f"{path.name}:{getattr(node, 'name', '<module>')}")
    assert not cited, f"docstrings that cite an issue number: {cited}"


@pytest.mark.parametrize("ref", [":mod:`.nowhere`", "fsdp_optim.untrusted.MAX_WORLD_SIZE", ":func:`no_such_function`"])
def test_a_broken_reference_is_found(ref: str) -> None:
    text = f"see {ref}"
    dotted = [m.group(0) for m in DOTTED.finditer(text)]
    sphinx = [m.group(2) for m in SPHINX.finditer(text)]
    assert dotted or sphinx, f"{ref}: not recognised as a reference"
    for found in dotted + sphinx:
        assert all(_resolve(c) is _MISSING for c in _candidates(found, "fsdp_optim.formats.kinds")), found
