"""Only transport.py talks to torch.distributed (and the demo, which is a user program, and dcp.py, which
writes DCP files with no process group): every other module is pure of collectives. Checked on the source,
so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_optim"
# dcp.py writes PyTorch's checkpoint format, whose API lives under torch.distributed.checkpoint; it saves
# with no_dist=True and calls no collective.
ALLOWED = {"job/transport.py", "demo.py", "formats/dcp.py"}
PURE = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if str(p.relative_to(PACKAGE)) not in ALLOWED)


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

def test_the_pure_layer_does_not_reach_collectives_through_transport() -> None:
    for module in ["core/layout.py", "core/flatten.py", "formats/fullstate.py", "job/local.py", "formats/sharded/manifest.py", "core/plan.py", "core/preconditions.py", "offline/operations.py", "offline/cuts.py"]:
        imported = _imports(PACKAGE / module)
        assert "transport" not in {name.rsplit(".", 1)[-1] for name in imported}, (module, sorted(imported))
