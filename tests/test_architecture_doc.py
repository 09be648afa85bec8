"""ARCHITECTURE.md names every module of the package in its own folder's row, and every module it names exists.

The table has one row per folder of the package (``| `job/` | ... |``); a sub-folder is named inside its parent's
row with its own modules in parentheses (``sharded/ (... `reader.py` ...)``). A module of a folder counts as named
when that folder's text (its row, or its parentheses, less any sub-folder's parentheses) names it by file name
(``stager.py``), or when any row names it by its path from the package (``offline/parallel/reshard.py``,
``job/save_commit.commit_save``). A module at the package's top (``fairseq.py``) may be named anywhere.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_optim"
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
FILES = re.findall(r"(?<![\w.])((?:\w+/)*\w+)\.py\b", TEXT)  # "stager.py", "job/team.py" -> "stager", "job/team"
ROW = re.compile(r"^\| `(\w+)/` \| (.*) \|$", re.MULTILINE)
SUBFOLDER = re.compile(r"`(\w+)/` \(")
# "stager.py" or "parallel/reshard.py" (groups 1, 2); "job/save_commit.commit_save" (groups 3, 4)
MENTION = re.compile(r"(?<![\w.])((?:\w+/)*)(\w+)\.py\b|(?<![\w.])((?:\w+/)+)(\w+)\.\w+")


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise AssertionError(f"ARCHITECTURE.md: a parenthesis opened at {text[start:start + 40]!r} is never closed")


def folder_texts(folder: str, text: str) -> dict[str, str]:
    """``{folder: its own text}`` for ``folder`` and each sub-folder named in ``text`` with its parentheses."""
    texts, own, at = {}, [], 0
    while (found := SUBFOLDER.search(text, at)) is not None:
        own.append(text[at : found.start()])
        end = _closing(text, found.end() - 1)
        texts.update(folder_texts(f"{folder}/{found[1]}", text[found.end() : end]))
        at = end + 1
    texts[folder] = "".join(own) + text[at:]
    return texts


def named_modules() -> set[tuple[str, str]]:
    """(folder from the package, file stem) of every module the table names."""
    named = set()
    rows = ROW.findall(TEXT)
    assert rows, "ARCHITECTURE.md has no folder rows (| `core/` | ... |)"
    for top, row in rows:
        for folder, text in folder_texts(top, row).items():
            for found in MENTION.finditer(text):
                path, stem = (found[1], found[2]) if found[2] else (found[3], found[4])
                named.add((path.rstrip("/") or folder, stem))
    return named


def test_every_module_of_the_package_is_named_in_its_folders_row() -> None:
    named = named_modules()
    anywhere = {n.rsplit("/", 1)[-1] for n in FILES}
    missing = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if (p.parent == PACKAGE and p.stem not in anywhere)
        or (p.parent != PACKAGE and (p.parent.relative_to(PACKAGE).as_posix(), p.stem) not in named)
    ]
    assert not missing, f"modules ARCHITECTURE.md does not name in their folder's row: {missing}"


def test_a_module_named_in_another_folders_row_is_not_counted_there() -> None:
    text = "`a.py` (one), `sub/` (`b.py` (two), `deeper/` (`c.py`)), `d.py`, `other/e.py`"
    texts = folder_texts("top", text)
    assert set(texts) == {"top", "top/sub", "top/sub/deeper"}, f"folders found: {sorted(texts)}"
    assert "b.py" not in texts["top"] and "c.py" not in texts["top/sub"], f"a sub-folder's text leaked: {texts}"
    assert "a.py" in texts["top"] and "d.py" in texts["top"], f"the folder's own text lost a module: {texts}"


def test_every_module_it_names_exists() -> None:
    modules = {(p.parent.relative_to(PACKAGE).as_posix(), p.stem) for p in _modules()}
    elsewhere = {p.stem for p in (ROOT / "tests").glob("*.py")} | {p.stem for p in (ROOT / "benchmarks").rglob("*.py")}
    top_files = {stem for folder, stem in modules if folder == "."}
    ghosts = sorted(
        f"{folder}/{stem}"
        for folder, stem in named_modules()
        if (folder, stem) not in modules and stem not in top_files and not (PACKAGE / folder / stem).is_dir()
    )
    assert not ghosts, f"ARCHITECTURE.md names modules that are not in the folder it names them in: {ghosts}"
    stems = {stem for _, stem in modules} | elsewhere | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    ghosts = sorted({n for n in FILES if n.rsplit("/", 1)[-1] not in stems})
    assert not ghosts, f"ARCHITECTURE.md names modules that do not exist: {ghosts}"
