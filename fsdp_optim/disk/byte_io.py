"""The bytes of a backend: :class:`ByteIO`, the eight primitives every place holding named objects implements, and
what follows from them (sizes, ranged reads, copies), which a backend overrides where it can do better::

    __str__()                          its name, e.g. "mystore://bucket/run/step-10" (its identity in every process)
    child(name)                        the backend one level below ("step-10" under a manager's root)
    listing()                          {name: StoredObject(name, size, mtime, etag)}: the objects directly below
    prefixes()                         the names of the levels directly below, sorted
    read_into(name, start, targets)    fill the writable buffers ``targets``, in order, from byte ``start`` on
    write(name, data)                  one object written whole (``bytes``, or a local file's ``Path``), atomically:
                                       a reader sees the old object or the new one, never a part
    commit(name, data, replaces=etag)  the commit primitive: write ``data`` only if the object's etag is still
                                       ``replaces`` (``None``: only if there is none), else ConcurrentCommitError
    delete(names)                      remove objects (missing ones are not an error)
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ByteIO", "StoredObject", "Tiling", "listed_etag", "read_all"]

_DOWNLOAD_PIECE = 16 << 20  # bytes a default download reads at a time


@dataclass(frozen=True)
class StoredObject:
    """One object directly under a location: its name (relative), size, modification time and etag (if any)."""

    name: str
    size: int
    mtime: float | None
    etag: str | None


class ByteIO(ABC):
    """The byte-level primitives of a backend (see the module docstring), and the reads and writes made of them."""

    @abstractmethod
    def __str__(self) -> str: ...

    @abstractmethod
    def child(self, name: str) -> ByteIO: ...

    @abstractmethod
    def listing(self) -> dict[str, StoredObject]: ...

    @abstractmethod
    def prefixes(self) -> list[str]: ...

    @abstractmethod
    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None: ...

    @abstractmethod
    def write(self, name: str, data: bytes | Path) -> None: ...

    @abstractmethod
    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None: ...

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None: ...

    # -- what follows from them ----------------------------------------------------------------------------------

    def size(self, name: str) -> int | None:
        found = self.listing().get(name)
        return None if found is None else found.size

    def read_range(self, name: str, start: int, stop: int) -> bytes | bytearray:
        """Bytes ``[start, stop)`` of object ``name`` (``FileNotFoundError`` when absent)."""
        out = bytearray(max(stop - start, 0))
        self.read_into(name, start, [memoryview(out)])
        return out

    def download(self, name: str, local: Path, *, size: int) -> None:
        """Copy object ``name`` (``size`` bytes) into the new local file ``local``, a piece at a time."""
        with open(local, "wb") as out:
            for start in range(0, size, _DOWNLOAD_PIECE):
                out.write(self.read_range(name, start, min(start + _DOWNLOAD_PIECE, size)))


def listed_etag(found: StoredObject | None) -> str | None:
    """An object's version as a listing just gave it (``None``: not listed), for :meth:`ByteIO.commit`'s
    ``replaces``: its etag, else its size and time."""
    if found is None:
        return None
    return found.etag if found.etag is not None else f"{found.size}-{found.mtime}"


def read_all(loc: ByteIO, name: str, *, limit: int, size: int | None = None) -> bytes:
    """Object ``name`` of ``loc`` whole (at most ``limit`` bytes, else ``ValueError``); ``FileNotFoundError`` when
    absent. ``size``: its size as a listing just gave it (not asked again); by default :meth:`ByteIO.size` asks."""
    size = loc.size(name) if size is None else size
    if size is None:
        raise FileNotFoundError(f"{loc}/{name}: no such object")
    if size > limit:
        raise ValueError(f"{loc}/{name}: {size} bytes, above the bound for it ({limit})")
    return bytes(loc.read_range(name, 0, size))


class Tiling:
    """Buffers tiling the bytes from ``start`` on (a :meth:`ByteIO.read_into`'s ``targets``): :meth:`copy` puts bytes
    at an offset into those they cover."""

    def __init__(self, start: int, targets: Sequence[memoryview]) -> None:
        self.targets = [t.cast("B") if t.format != "B" or t.ndim != 1 else t for t in targets]
        self.starts = list(itertools.accumulate((t.nbytes for t in self.targets), initial=start))

    def copy(self, at: int, data: bytes | bytearray) -> None:
        k = max(bisect.bisect_right(self.starts, at) - 1, 0)
        done = 0
        while done < len(data):
            target, lo = self.targets[k], at + done - self.starts[k]
            n = min(len(data) - done, target.nbytes - lo)
            target[lo : lo + n] = data[done : done + n]
            done, k = done + n, k + 1
