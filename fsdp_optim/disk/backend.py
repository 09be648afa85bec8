"""A new storage backend in one small class: :class:`ObjectBackend`.

A backend implements eight byte-level methods; everything else a :class:`~fsdp_optim.disk.location.Location` does
(naming, sizes, ranged reads, staging, the save protocol of :mod:`~fsdp_optim.disk.store_save`: foreign content
refused, files published under the save's unique names, the manifest committed last by the backend's conditional
create, what a replaced checkpoint left removed after) is written once, here and in the classes above it::

    __str__()                          its URL, e.g. "mystore://bucket/run/step-10" (its identity in every process)
    child(name)                        the backend one level below ("step-10" under a manager's root)
    listing()                          {name: StoredObject(name, size, mtime, etag)}: the objects directly below
    prefixes()                         the names of the levels directly below, sorted
    read_into(name, start, targets)    fill the writable buffers ``targets``, in order, from byte ``start`` on
    write(name, data)                  one object written whole (``bytes``, or a local file's ``Path``), atomically:
                                       a reader sees the old object or the new one, never a part
    commit(name, data, replaces=etag)  the commit primitive: write ``data`` only if the object's etag is still
                                       ``replaces`` (``None``: only if there is none), else ConcurrentCommitError
    delete(names)                      remove objects (missing ones are not an error)

A backend that can do better overrides one more method (a ranged GET of its own: ``read_range``; a whole-object copy:
``download``); callers never ask which backend they hold. Register it for a URL scheme with
:func:`~fsdp_optim.disk.locations.register_backend`, or pass an instance wherever a path is taken.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from fsdp_optim.disk.location import Location, ObjectPath, StoredObject
from fsdp_optim.disk.store_policy import RetryPolicy
from fsdp_optim.disk.store_save import StoreSaving

__all__ = ["ObjectBackend"]


class ObjectBackend(StoreSaving):
    """The base of a backend the package has no code for (see the module docstring for the eight methods)."""

    policy = RetryPolicy(float("inf"), attempts=1)  # a backend retries inside its own methods, if it needs to

    @abstractmethod
    def __str__(self) -> str: ...

    @abstractmethod
    def child(self, name: str) -> Location: ...

    @abstractmethod
    def listing(self) -> dict[str, StoredObject]: ...

    @abstractmethod
    def prefixes(self) -> list[str]: ...

    @abstractmethod
    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None: ...

    @abstractmethod
    def write(self, name: str, data: bytes | Path) -> None:
        """Object ``name`` written whole from ``data`` (bytes, or a local file to copy), atomically."""

    @abstractmethod
    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None: ...

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None: ...

    # -- what follows from them --------------------------------------------------------------------------------

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.identity() == self.identity()

    def __hash__(self) -> int:
        return hash(self.identity())

    def size(self, name: str) -> int | None:
        found = self.listing().get(name)
        return None if found is None else found.size

    def etag(self, name: str) -> str | None:
        """The object's etag as :meth:`listing` gives it (its size and time where the backend gives none)."""
        found = self.listing().get(name)
        if found is None:
            return None
        return found.etag if found.etag is not None else f"{found.size}-{found.mtime}"

    def upload(self, local: Path, name: str) -> None:
        self.write(name, local)

    def put(self, name: str, data: bytes) -> None:
        self.write(name, data)
