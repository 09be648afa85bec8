"""A census of the source tree: the counts that say how much indirection and repetition the package carries.
Reads the source only (``ast``; imports nothing of the package) and prints one table; ``--json`` prints it as JSON.

    python -m benchmarks.census [--root DIR] [--json]

What each row counts (the rules are approximations written down here, so that two runs compare):

- ``package lines``: lines of every ``fsdp_optim/**/*.py``; ``files over 400 lines``: those above the cap.
- ``Location members``: names defined in the body of ``disk/location.py``'s ``Location`` and of its bases found in
  ``disk/`` (``ByteIO``): methods, properties, dunders and class attributes, each name once.
- ``failure captures``: an ``except ... as exc:`` whose body assigns ``exc`` (alone, or as an element of a tuple or
  an argument of a call) to a name, in a function that passes that name to a call of ``agree*`` or ``settle*``.
- ``forwarding imports``: in ``fsdp_optim/``, ``tests/`` and ``benchmarks/``, a ``from A import x`` where ``A`` is one
  of those modules, does not define ``x`` and is not the public face (``fsdp_optim``, ``fsdp_optim.fairseq``),
  but imports ``x`` itself from elsewhere (a submodule ``A.x`` is not a name through ``A``).
- ``public names defined twice``: a public name (no leading ``_``) of a top-level ``def`` or ``class`` in two or
  more modules of ``fsdp_optim/`` (module-level assignments such as constants and type variables are not counted).
- ``docs/api.md internal entries``: ``::: path`` entries whose path is neither ``fsdp_optim.X`` nor
  ``fsdp_optim.fairseq[.X]``.
- ``dead functions``: which of the five functions issue 46 named dead are still defined.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CAP = 400
PUBLIC_FACES = ("fsdp_optim", "fsdp_optim.fairseq")
DEAD = (
    ("fsdp_optim/formats/sharded/writer.py", "begin_write"),
    ("fsdp_optim/formats/sharded/writer.py", "end_write"),
    ("fsdp_optim/offline/publish.py", "publish_checkpoint"),
    ("fsdp_optim/formats/sharded/writer.py", "rank_file_bytes"),
    ("fsdp_optim/formats/fullstate.py", "saved_optimizer"),
)


@dataclass
class Module:
    """One source file: its dotted name, the names it defines and those it imports (name -> (module, name))."""

    name: str
    path: Path
    tree: ast.Module
    is_package: bool
    rel: str = ""
    defines: set[str] = field(default_factory=set)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)


def _dotted(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "tests":  # tests import each other as top-level modules (tests/ is on the path)
        parts = parts[1:]
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of the module ``node`` imports from."""
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements, looking inside ``if`` and ``try`` blocks."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _top_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_statements(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
    return out


def load(root: Path) -> dict[str, Module]:
    """Every module of ``fsdp_optim/``, ``tests/`` and ``benchmarks/`` by dotted name."""
    modules = {}
    for folder in ("fsdp_optim", "tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if "fixtures" in path.parts or "out" in path.relative_to(root).parts[1:2]:
                continue
            name, package = _dotted(root, path)
            modules[name] = Module(name, path, ast.parse(path.read_text()), package, path.relative_to(root).as_posix())
    for module in modules.values():
        for node in _top_statements(module.tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.defines.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                module.defines.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.ImportFrom):
                source = resolve(module, node)
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, ast.Import):
                module.defines.update((a.asname or a.name).split(".")[0] for a in node.names)
    return modules


def home(modules: dict[str, Module], source: str, name: str) -> str | None:
    """The module that defines ``name`` reached as ``from source import name`` (following re-imports), or None
    when it leaves the tree or is a submodule."""
    seen = set()
    while source in modules and (source, name) not in seen:
        seen.add((source, name))
        module = modules[source]
        if name in module.defines or f"{source}.{name}" in modules:
            return source
        if name not in module.imports:
            return None
        source, name = module.imports[name]
    return None


def forwarding_imports(modules: dict[str, Module]) -> list[str]:
    """``file:line from A import x (defined in B)`` for each import of a name through a module that re-imports it."""
    found = []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = resolve(module, node)
            if source not in modules or source in PUBLIC_FACES:
                continue
            for alias in node.names:
                target = modules[source]
                if alias.name in target.defines or f"{source}.{alias.name}" in modules or alias.name not in target.imports:
                    continue
                found.append(f"{module.rel}:{node.lineno} from {source} import {alias.name} (defined in {home(modules, source, alias.name)})")
    return sorted(found)


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def failure_captures(modules: dict[str, Module]) -> list[str]:
    """``file:line`` of each hand-written "catch the failure, then agree" (the rule in the module docstring)."""
    found = []
    for module in modules.values():
        if not module.name.startswith("fsdp_optim"):
            continue
        for func in ast.walk(module.tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            agreed: set[str] = set()
            for call in ast.walk(func):
                if isinstance(call, ast.Call):
                    callee = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                    if callee.startswith(("agree", "settle")):
                        agreed |= set().union(*(_names_in(a) for a in [*call.args, *(k.value for k in call.keywords)]))
            for handler in ast.walk(func):
                if not isinstance(handler, ast.ExceptHandler) or handler.name is None:
                    continue
                for stmt in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
                    if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and handler.name in _names_in(stmt.value or ast.Constant(None)):
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        if set().union(*(_names_in(t) for t in targets)) & agreed:
                            found.append(f"{module.rel}:{handler.lineno}")
                            break
    return sorted(set(found))


def location_members(modules: dict[str, Module]) -> list[str]:
    """Names defined in ``Location``'s body and its bases' found in ``fsdp_optim.disk``."""
    classes = {
        node.name: node
        for module in modules.values()
        if module.name.startswith("fsdp_optim.disk")
        for node in module.tree.body
        if isinstance(node, ast.ClassDef)
    }
    names: set[str] = set()
    todo = ["Location"]
    while todo:
        cls = classes.get(todo.pop())
        if cls is None:
            continue
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return sorted(names)


def defined_twice(modules: dict[str, Module]) -> dict[str, list[str]]:
    """Public top-level ``def``/``class`` names of ``fsdp_optim/`` defined in two or more modules."""
    where = defaultdict(list)
    for module in modules.values():
        if module.name.startswith("fsdp_optim"):
            for node in module.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                    where[node.name].append(module.name)
    return {name: sorted(homes) for name, homes in sorted(where.items()) if len(homes) > 1}


def internal_api_entries(root: Path) -> list[str]:
    """``::: path`` entries of docs/api.md at a path other than ``fsdp_optim.X`` / ``fsdp_optim.fairseq[.X]``."""
    entries = re.findall(r"^::: (\S+)", (root / "docs" / "api.md").read_text(), flags=re.MULTILINE)
    public = re.compile(r"fsdp_optim(\.fairseq)?(\.\w+)?")
    return [e for e in entries if not public.fullmatch(e)]


def census(root: Path) -> dict[str, Any]:
    """Every count, with the lists behind it."""
    modules = load(root)
    sizes = {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in sorted((root / "fsdp_optim").rglob("*.py"))}
    dead = [f"{path}:{name}" for path, name in DEAD if (root / path).exists() and re.search(rf"^\s*def {name}\(", (root / path).read_text(), re.M)]
    return {
        "package lines": sum(sizes.values()),
        "files over 400 lines": {p: n for p, n in sizes.items() if n > CAP},
        "Location members": location_members(modules),
        "failure captures": failure_captures(modules),
        "forwarding imports": forwarding_imports(modules),
        "public names defined twice": defined_twice(modules),
        "docs/api.md internal entries": internal_api_entries(root),
        "dead functions present": dead,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.census", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    parser.add_argument("--json", action="store_true", help="print every count and list as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the list behind each count")
    args = parser.parse_args(argv)
    counts = census(args.root.resolve())
    if args.json:
        print(json.dumps(counts, indent=1))
        return 0
    print(f"census of {args.root.resolve()}")
    for key, value in counts.items():
        print(f"{key:32} {value if isinstance(value, int) else len(value)}")
        if args.verbose and not isinstance(value, int):
            for item in value.items() if isinstance(value, dict) else value:
                print(f"    {item[0]}: {item[1]}" if isinstance(item, tuple) else f"    {item}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
