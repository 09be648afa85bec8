"""ARCHITECTURE.md names every module of the package, and every module it names exists.

A module is named by its file name (``stager.py``) or by a path ending in it (``job/save_commit.commit_save``,
``offline/parallel/reshard.py``); a name that two folders share counts for both, which the table's folder column
tells apart for a reader.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_optim"
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
FILES = re.findall(r"(?<![\w.])((?:\w+/)*\w+)\.py\b", TEXT)  # "stager.py", "job/team.py" -> "stager", "job/team"
DOTTED = re.findall(r"(?<![\w.])((?:\w+/)+\w+)\.\w+", TEXT)  # "job/save_commit.commit_save" -> "job/save_commit"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_every_module_of_the_package_is_named() -> None:
    named = {n.rsplit("/", 1)[-1] for n in FILES} | {n.rsplit("/", 1)[-1] for n in DOTTED}
    missing = [str(p.relative_to(PACKAGE)) for p in _modules() if p.stem not in named]
    assert not missing, f"modules ARCHITECTURE.md does not name: {missing}"


def test_every_module_it_names_exists() -> None:
    stems = {p.stem for p in _modules()} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    stems |= {p.stem for p in (ROOT / "benchmarks").rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    ghosts = sorted({n for n in FILES if n.rsplit("/", 1)[-1] not in stems})
    assert not ghosts, f"ARCHITECTURE.md names modules that do not exist: {ghosts}"
