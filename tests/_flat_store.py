"""A backend the package has no code for, written the way a user would add one: a single class.

:class:`FlatStore` keeps every object of every prefix as one file of a flat local directory (the object's key, with
its "/" escaped, is the file's name), has no local path to map (it is read by ranged reads, like a store), and
commits by a rule of its own: a compare-and-swap of the manifest under an exclusive ``flock``. It subclasses
:class:`~fsdp_optim.disk.store_save.StoreSaving`, the save protocol of any store, and implements only object
operations. ``tests/test_location.py`` runs it through the same calls, and a real job, as the package's backends.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, unquote

from fsdp_optim.disk.location import Location, ObjectPath, StoredObject
from fsdp_optim.disk.storage import ConcurrentCommitError
from fsdp_optim.disk.store_policy import RetryPolicy
from fsdp_optim.disk.store_save import StoreSaving

__all__ = ["FlatStore"]


class FlatStore(StoreSaving):
    """Prefix ``prefix`` of the objects kept in the flat directory ``root``."""

    policy = RetryPolicy(float("inf"), attempts=1)

    def __init__(self, root: str | os.PathLike[str], prefix: str) -> None:
        self.root, self.prefix = Path(root), prefix.strip("/")
        self.root.mkdir(parents=True, exist_ok=True)

    def __str__(self) -> str:
        return f"flat://{self.root.name}/{self.prefix}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatStore) and (other.root, other.prefix) == (self.root, self.prefix)

    def __hash__(self) -> int:
        return hash((self.root, self.prefix))

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self, name)

    def child(self, name: str) -> Location:
        return FlatStore(self.root, f"{self.prefix}/{name}")

    def parent(self) -> Location:
        return FlatStore(self.root, self.prefix.rsplit("/", 1)[0])

    def _file(self, name: str) -> Path:
        return self.root / quote(f"{self.prefix}/{name}", safe="")

    def _keys(self) -> Iterator[tuple[list[str], os.DirEntry[str]]]:
        """Every object below this prefix: its key's parts after the prefix, and its file."""
        for entry in os.scandir(self.root):
            key = unquote(entry.name)
            if entry.is_file() and key.startswith(f"{self.prefix}/"):
                yield key[len(self.prefix) + 1 :].split("/"), entry

    # -- reading

    def listing(self) -> dict[str, StoredObject]:
        found = {}
        for parts, entry in self._keys():
            if len(parts) == 1:
                st = entry.stat()
                found[parts[0]] = StoredObject(parts[0], st.st_size, st.st_mtime, self._tag(st))
        return found

    def prefixes(self) -> list[str]:
        return sorted({parts[0] for parts, _ in self._keys() if len(parts) > 1})

    def size(self, name: str) -> int | None:
        try:
            return self._file(name).stat().st_size
        except FileNotFoundError:
            return None

    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None:
        with open(self._file(name), "rb") as f:
            f.seek(start)
            for target in targets:
                if f.readinto(target) != target.nbytes:
                    raise OSError(f"{self / name}: shorter than the bytes asked for")

    # -- writing

    def upload(self, local: Path, name: str) -> None:
        temporary = self.root / f".{uuid.uuid4().hex}"
        shutil.copyfile(local, temporary)
        os.replace(temporary, self._file(name))

    def put(self, name: str, data: bytes) -> None:
        temporary = self.root / f".{uuid.uuid4().hex}"
        temporary.write_bytes(data)
        os.replace(temporary, self._file(name))

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            self._file(name).unlink(missing_ok=True)

    # -- its commit rule

    @staticmethod
    def _tag(st: os.stat_result) -> str:
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def etag(self, name: str) -> str | None:
        try:
            return self._tag(self._file(name).stat())
        except FileNotFoundError:
            return None

    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None:
        with self._locked():
            found = self.etag(name)
            if found != replaces:
                raise ConcurrentCommitError(f"{self / name}: committed by another writer ({found}, expected {replaces})")
            self.put(name, data)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".commit-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
