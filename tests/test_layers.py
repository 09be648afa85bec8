"""The tree is the layer table: which folder may import which, checked on the source (lazy imports count).

    core (0)  <  disk (1)  <  formats (2)  <  job (3)  <  offline (4)  <  the package's top files (5)

A module imports only from its own layer or lower ones; no module imports itself back through others (no
cycles); fairscale's private attributes, and the attributes its FSDP sets on an instance (``fsdp.world_size``,
``.process_group``, ``.params``), are read only where ``job/root.py`` and ``job/host.py`` read them; no module is
over 400 lines and no function over 60; every ``assert`` carries a message.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_optim"
LAYERS = {"core": 0, "disk": 1, "formats": 2, "job": 3, "offline": 4}
TOP = 5
MODULES = sorted(PACKAGE.rglob("*.py"))
FAIRSCALE_HOMES = ("job/root.py", "job/host.py")


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def _imports(path: Path) -> set[str]:
    """fsdp_optim modules that ``path`` imports, at module level or inside functions."""
    known = {_name(p) for p in MODULES}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(n for n in names if n in known)
    return found - {_name(path)}


GRAPH = {_name(p): _imports(p) for p in MODULES}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_against_the_layer_order(module: str) -> None:
    upward = sorted(m for m in GRAPH[module] if _layer(m) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def test_no_relative_imports() -> None:
    relative = [str(p.relative_to(PACKAGE)) for p in MODULES if any(
        isinstance(n, ast.ImportFrom) and n.level > 0 for n in ast.walk(ast.parse(p.read_text())))]
    assert not relative, f"modules with relative imports (write fsdp_optim.<layer>.<module>): {relative}"


def test_no_import_cycles() -> None:
    # A package's __init__ re-exports its modules; the edge parent -> child is not a cycle of ideas.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, f"import cycles: {cycles}"


def _private_reads(path: Path) -> set[str]:
    """Private attributes read on objects other than ``self`` / ``cls`` (``fsdp._is_root``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.add(node.attr)
    return out


def test_fairscale_privates_only_in_their_two_homes() -> None:
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
    import fairscale.nn.misc.flatten_params_wrapper as flat_module

    theirs = {n for m in (fsdp_module, flat_module) for n in _private_reads(Path(m.__file__))}
    theirs |= {n for n in vars(fsdp_module.FullyShardedDataParallel) if n.startswith("_") and not n.startswith("__")}
    for path in MODULES:
        rel = str(path.relative_to(PACKAGE))
        if rel in FAIRSCALE_HOMES:
            continue
        # our own privates (a leading underscore on our records) are not fairscale's
        ours = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        found = sorted(_private_reads(path) & theirs - ours)
        assert not found, f"{rel} reads fairscale's private attributes {found}; only {FAIRSCALE_HOMES} may"


def _fsdp_instance_attributes() -> set[str]:
    """Public attributes fairscale's FSDP assigns on ``self`` (``world_size``, ``params``...), less nn.Module's."""
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
    from torch import nn

    tree = ast.parse(Path(fsdp_module.__file__).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "FullyShardedDataParallel")
    assigned = {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    }
    return {a for a in assigned if not a.startswith("_") and a not in dir(nn.Module())}


# What modules call a fairscale FSDP instance; the typed record job/root.py returns is named `root`, not these.
FSDP_NAMES = ("fsdp", "model", "instance", "module")


def test_fsdp_instance_attributes_only_in_their_two_homes() -> None:
    attributes = _fsdp_instance_attributes()
    assert {"world_size", "rank", "process_group", "params"} <= attributes  # the test reads fairscale right
    for path in MODULES:
        rel = str(path.relative_to(PACKAGE))
        if rel in FAIRSCALE_HOMES:
            continue
        found = sorted(
            f"{node.value.id}.{node.attr} (line {node.lineno})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in FSDP_NAMES and node.attr in attributes
        )
        assert not found, f"{rel} reads fairscale FSDP's attributes {found}; read them from job.root.verify_root's Root"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_assert_has_a_message(path: Path) -> None:
    bare = [node.lineno for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert) and node.msg is None]
    assert not bare, (
        f"{path.relative_to(PACKAGE)}: assert without a message at lines {bare}; python -O strips asserts, so what a "
        "caller or a file supplies needs a real check (ValueError/TypeError, expected vs found), and an internal "
        "invariant a message saying what broke"
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_small_modules_and_functions(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.name}: {len(text.splitlines())} lines, at most 400"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 60, f"{path.name}:{node.lineno} {node.name} is {length} lines, at most 60"


def test_every_folder_is_a_package() -> None:
    # setup.py's find_packages() installs only folders with an __init__.py: a folder without one is lost
    folders = {p.parent for p in MODULES}
    missing = sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"folders without __init__.py (not installed by pip install .): {missing}"
