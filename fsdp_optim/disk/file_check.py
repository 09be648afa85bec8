"""One file's verdict, read end to end and never raised: present, of its size, its zip CRCs, then a format's read.

Knows no format: a format's verification (:mod:`fsdp_optim.formats.sharded.verification`, the shard-set branch of
:mod:`fsdp_optim.offline.verify`) passes the read that checks its own checksums. A damaged file is reported in a
:class:`FileCheck` (``missing``, ``truncated: 3000 of 6985 bytes``, a checksum), collected into a
:class:`Verification`.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_optim.core.health import Finding
from fsdp_optim.disk.errors import StoreUnavailable
from fsdp_optim.disk.location import Location, ObjectPath

__all__ = ["FileCheck", "Verification", "check_file"]


@dataclass(frozen=True)
class FileCheck:
    """One file's verdict: ``detail`` starts with ``ok`` or says what is wrong."""

    path: Path | ObjectPath
    ok: bool
    detail: str


@dataclass(frozen=True)
class Verification:
    """What a verification found: one :class:`FileCheck` per file, every problem (``problems``: one line per damaged
    file, naming it, then the problems of the whole) and, deep, the findings in the state (``deep`` says whether it
    was read for them). ``ok`` is false exactly when ``problems`` or ``findings`` is not empty."""

    path: Path | Location
    kind: str
    files: tuple[FileCheck, ...]
    problems: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    deep: bool = False

    def __post_init__(self) -> None:
        damaged = _file_problems(self.files)
        object.__setattr__(self, "problems", damaged + tuple(p for p in self.problems if p not in damaged))

    @property
    def ok(self) -> bool:
        return not self.problems and not self.findings

    def lines(self) -> list[str]:
        """The report: one line per file (``name: ok ...`` or ``name: what is wrong``), the problems of the whole,
        the findings."""
        damaged = _file_problems(self.files)
        files = [f"{f.path.name}: {f.detail}" for f in self.files]
        return files + [p for p in self.problems if p not in damaged] + [str(f) for f in self.findings]

    def damaged(self) -> list[str]:
        """One line per problem, each naming its file (or its parameter and state key)."""
        return list(self.problems) + [str(f) for f in self.findings]

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "ok": self.ok,
            "deep": self.deep,
            "files": [{"path": str(f.path), "ok": f.ok, "detail": f.detail} for f in self.files],
            "problems": list(self.problems),
            "findings": [
                {"param": f.param, "group": f.group, "key": f.key, "problem": f.problem} for f in self.findings
            ],
        }


def _file_problems(files: tuple[FileCheck, ...]) -> tuple[str, ...]:
    return tuple(f"{f.path}: {f.detail}" for f in files if not f.ok)


def _zip_problem(path: Path) -> str | None:
    """Every record's CRC-32 against the zip's central directory (reads every byte once)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return f"not a readable zip file ({type(exc).__name__}: {exc})"
    return None if bad is None else f"zip record '{bad}' fails its CRC-32 checksum (the bytes were changed)"


def check_file(
    path: Path | ObjectPath,
    read: Callable[[Any], object],
    *,
    nbytes: int | None = None,
    sizes_only: bool = False,
    zipped: bool = True,
) -> FileCheck:
    """Presence, size (against ``nbytes`` when known), zip CRCs, then ``read(path)``; never raises for damage.
    ``path`` may be an object in a store (its size asked of the store; never a zip there)."""
    try:
        size = _size(path)
    except StoreUnavailable:
        raise  # the store did not answer: nothing is known of the file (never reported as damage)
    except OSError as exc:
        return FileCheck(path, False, f"unreadable: {exc}")
    if size is None:
        expected = f" ({nbytes} bytes)" if nbytes is not None else ""
        return FileCheck(path, False, f"missing{expected}")
    if size < 0:
        return FileCheck(path, False, "not a regular file")
    if nbytes is not None and size != nbytes:
        what = "truncated: " if size < nbytes else ""
        return FileCheck(path, False, f"{what}{size} of {nbytes} bytes (the size the manifest records)")
    if sizes_only:
        return FileCheck(path, True, f"ok: {size} bytes")
    # torch.save files are zips with a CRC-32 per record; format-2 and -3 rank files are safetensors, whose chunk
    # checksums (in the manifest, format 2; in the file's header, format 3) the read below verifies.
    if isinstance(path, Path) and path.suffix != ".safetensors" and zipped and (problem := _zip_problem(path)):
        return FileCheck(path, False, problem)
    try:
        detail = read(path)
    except StoreUnavailable:
        raise
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        return FileCheck(path, False, str(exc).removeprefix(f"{path}: ").removeprefix(f"{path}, "))
    return FileCheck(path, True, f"ok: {size} bytes{detail if isinstance(detail, str) else ''}")


def _size(path: Path | ObjectPath) -> int | None:
    """The file's size; ``None`` when it is missing, ``-1`` when it is not a regular file."""
    if isinstance(path, ObjectPath):
        return path.store.size(path.name)
    if not os.path.lexists(path):
        return None
    return path.stat().st_size if path.is_file() else -1
