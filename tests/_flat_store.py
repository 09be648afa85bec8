"""A backend the package has no code for, written the way a user adds one: one :class:`ObjectBackend`, 8 methods.

:class:`FlatStore` keeps every object of every prefix as one file of a flat local directory (the object's key, "/"
escaped, is the file's name), has no local path to map (it is read by ranged reads, like a store), and commits by a
rule of its own: a compare-and-swap of the manifest under an exclusive ``flock``. ``tests/test_location.py`` runs it
through the same calls, and a real job, as the package's backends.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import quote, unquote

from fsdp_optim import ConcurrentCommitError, ObjectBackend, StoredObject


class FlatStore(ObjectBackend):
    """Prefix ``prefix`` of the objects kept in the flat directory ``root``."""

    def __init__(self, root: str | os.PathLike[str], prefix: str) -> None:
        self.root, self.prefix = Path(root), prefix.strip("/")
        self.root.mkdir(parents=True, exist_ok=True)

    def __str__(self) -> str:
        return f"flat://{self.root}/{self.prefix}"

    def child(self, name: str) -> FlatStore:
        return FlatStore(self.root, f"{self.prefix}/{name}")

    def parent(self) -> FlatStore:  # optional: for a URL naming one object rather than a checkpoint
        return FlatStore(self.root, self.prefix.rsplit("/", 1)[0])

    def _file(self, name: str) -> Path:
        return self.root / quote(f"{self.prefix}/{name}", safe="")

    def _below(self) -> Iterable[tuple[list[str], os.DirEntry[str]]]:
        for entry in os.scandir(self.root):
            key = unquote(entry.name)
            if entry.is_file() and key.startswith(f"{self.prefix}/"):
                yield key[len(self.prefix) + 1 :].split("/"), entry

    def listing(self) -> dict[str, StoredObject]:
        stats = {parts[0]: entry.stat() for parts, entry in self._below() if len(parts) == 1}
        return {n: StoredObject(n, st.st_size, st.st_mtime, f"{st.st_ino}-{st.st_mtime_ns}") for n, st in stats.items()}

    def prefixes(self) -> list[str]:
        return sorted({parts[0] for parts, _ in self._below() if len(parts) > 1})

    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None:
        with open(self._file(name), "rb") as f:
            f.seek(start)
            if any(f.readinto(target) != target.nbytes for target in targets):
                raise OSError(f"{self / name}: shorter than the bytes asked for")

    def write(self, name: str, data: bytes | Path) -> None:
        temporary = self.root / f".{uuid.uuid4().hex}"
        shutil.copyfile(data, temporary) if isinstance(data, Path) else temporary.write_bytes(data)
        os.replace(temporary, self._file(name))

    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None:
        with open(self.root / ".commit-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if (found := self.etag(name)) != replaces:
                raise ConcurrentCommitError(f"{self / name}: committed by another writer ({found}, not {replaces})")
            self.write(name, data)

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            self._file(name).unlink(missing_ok=True)


def open_flat(url: str, options: object) -> FlatStore:  # noqa: ARG001 - it takes no options
    """The opener for :func:`fsdp_optim.register_backend`: ``flat://ROOT/ckpt-NAME[/below]``."""
    root, _, prefix = url.removeprefix("flat://").partition("/ckpt-")
    return FlatStore(root, f"ckpt-{prefix}")
