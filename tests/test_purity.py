"""The pure layer never talks to torch.distributed: only transport.py (and the FSDP wrapper that
orchestrates it) may. Checked on the source, so an indirect import cannot hide behind a lazy one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_optim"
PURE = ["layout.py", "flatten.py", "fullstate.py", "local.py"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", PURE)
def test_pure_module_does_not_import_torch_distributed(module: str) -> None:
    imported = _imports(PACKAGE / module)
    assert not {name for name in imported if name.startswith("torch.distributed")}, sorted(imported)
    assert "transport" not in {name.rsplit(".", 1)[-1] for name in imported}, sorted(imported)
