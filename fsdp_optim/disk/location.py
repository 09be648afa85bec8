"""Where a checkpoint's files live: one interface, :class:`Location`, and one class per backend.

A backend is a directory-like place holding named objects: :class:`~fsdp_optim.disk.local_directory.LocalDirectory`
(rename and a lock), :class:`~fsdp_optim.disk.storage.ObjectStore` (a prefix of any fsspec filesystem; a conditional
put), :class:`~fsdp_optim.job.node_memory.NodeMemory` (the memory tier, in ``job/``: its commit and prefetch are
collectives). Readers and writers above ``disk/`` take a ``Location`` and call its members; none asks which kind it is.

A backend implements the eight primitives of :class:`~fsdp_optim.disk.byte_io.ByteIO`; beyond them it may override
naming, ``local_path()`` (a path whose files are mapped in place), ``prefetch``, ``written_here``, ``removal``,
``multipart`` and ``writer(rules)``: how a save commits here (:mod:`fsdp_optim.disk.save`). What follows from the
members, the same for every backend, is a function below (a local path, where there is one, answers).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fsdp_optim.disk.byte_io import ByteIO
from fsdp_optim.disk.save import SaveRules, Writer

if TYPE_CHECKING:
    from fsdp_optim.disk.multipart import Multipart

__all__ = [
    "Location", "ObjectPath", "Where", "as_local_file", "base_name", "exists", "identity", "is_url", "non_objects",
    "present", "public", "same_place", "shared_directory", "uploaded",
]

T = TypeVar("T")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    """``path`` names an object store or another backend by URL (a scheme other than ``file://``), not a local
    path."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


@dataclass(frozen=True)
class ObjectPath:
    """One object of a location that has no local path, shown as its URL (what a ``Path`` is to a directory)."""

    store: Location
    name: str

    def __str__(self) -> str:
        return f"{self.store}/{self.name}"

    @property
    def parent(self) -> Location:
        return self.store


class Location(ByteIO):
    """A place holding a checkpoint's files (see the module docstring)."""

    # -- naming --------------------------------------------------------------------------------------------

    def __truediv__(self, name: str) -> Path | ObjectPath:
        """Object ``name`` as shown to a user (a ``Path``, or an ``ObjectPath`` that prints as its URL)."""
        return ObjectPath(self, name)

    @abstractmethod
    def child(self, name: str) -> Location: ...

    def local_path(self) -> Path | None:
        """The local path whose files readers map or open in place; ``None``: read by ranges, written by uploads."""
        return None

    def parent(self) -> Location:
        """The location this one is directly below (of an object's URL: the prefix holding it)."""
        raise NotImplementedError(f"{self}: no parent location")

    # -- reading -------------------------------------------------------------------------------------------

    def prefetch(
        self, spans: Callable[[], Sequence[Any]]  # noqa: ARG002 - nothing fetched ahead by default
    ) -> AbstractContextManager[Mapping[str, Sequence[Any]] | None]:
        """The byte ranges ``spans()`` lists (:class:`~fsdp_optim.disk.prefetch.SpanLike`) fetched ahead of their use
        within the block: their pieces by object name (each with ``bytes()``, ``used()``); ``None`` where nothing is
        fetched ahead (``spans`` is then not called)."""
        return nullcontext(None)

    # -- writing and removing ------------------------------------------------------------------------------

    def removal(self, *, purpose: str) -> AbstractContextManager[Callable[[], None] | None]:  # noqa: ARG002
        """Held while this location is emptied and removed: ``None`` when a writer holds it (then nothing may be
        removed), else the call that removes, once its objects are deleted, what keeps it listed (a local directory
        itself under its lock, ``purpose`` telling a second writer why; a store's "directory" object)."""
        return nullcontext(lambda: None)

    @contextmanager
    def written_here(
        self, publishing: Callable[[Path], AbstractContextManager[T]]
    ) -> Iterator[tuple[str | os.PathLike[str], T | None]]:
        """A local path at which to write (or read) this location, and what ``publishing(local)`` yields: here a
        scratch copy in ``$TMPDIR`` entered in ``publishing(local)`` (which fetches it, or uploads and commits it as
        the block ends), removed however it ends. A local directory is its own path as given, and ``None``."""
        scratch = Path(tempfile.mkdtemp(prefix="fsdp_optim-out-"))
        try:
            local = scratch / base_name(self)
            with publishing(local) as published:
                yield local, published
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # -- what it can do (asked by name of the capability, never of the backend) ------------------------------

    def writer(self, rules: SaveRules) -> Writer:
        """How a save under ``rules`` commits here: by default a conditional put of the commit object."""
        return Writer(self, rules)

    def multipart(self, name: str) -> Multipart | None:  # noqa: ARG002 - none by default
        """Object ``name`` as the parts of one multipart upload (:mod:`~fsdp_optim.disk.multipart`), by any number
        of processes; ``None`` where the backend has none (written whole, by one writer)."""
        return None


Where = Path | Location  # a checkpoint directory as the readers hold it (local files mapped, or ranged reads)


# -- what follows from the members (the same for every backend: a local path, where there is one, answers) ----------


def base_name(loc: Location) -> str:
    """The last part of ``loc``'s name (of a URL naming one object: that object's name in the location above)."""
    path = loc.local_path()
    return str(loc).rstrip("/").rsplit("/", 1)[-1] if path is None else path.name


def public(loc: Location) -> Path | Location:
    """What the API hands back for ``loc``: its local path, else the location itself."""
    path = loc.local_path()
    return loc if path is None else path


def identity(loc: Location) -> str:
    """A name that says which location ``loc`` is in any process (a local directory's absolute path, else its URL)."""
    path = loc.local_path()
    return str(loc) if path is None else str(path.absolute())


def same_place(loc: Location, other: Location) -> bool:
    """Whether ``other`` names the very location ``loc`` does: the same directory once symlinks are resolved, else
    the same :func:`identity`."""
    path, other_path = loc.local_path(), other.local_path()
    if path is None and other_path is None:
        return identity(loc) == identity(other)
    return path is not None and other_path is not None and path.resolve() == other_path.resolve()


def exists(loc: Location) -> bool:
    """Whether there is a place here to list: a local directory while it is one; a store's prefix always."""
    path = loc.local_path()
    return True if path is None else path.is_dir()


def present(loc: Location) -> bool:
    """Whether ``loc`` is there now as a place of its own: a local directory while it exists, even empty; a store's
    prefix while an object is below it (an emptied prefix kept listed by its marker is not present)."""
    path = loc.local_path()
    return bool(loc.listing()) if path is None else path.is_dir()


def non_objects(loc: Location) -> list[str]:
    """The names directly under ``loc`` that are not objects (a local directory's subdirectories, links, devices),
    sorted; none where it has no local path."""
    path = loc.local_path()
    if path is None:
        return []
    try:
        return sorted(e.name for e in os.scandir(path) if not e.is_file(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def shared_directory(loc: Location) -> Path | None:
    """The directory every process sees, where several processes may write one output together (each its own files
    or byte ranges): a local directory's path; ``None`` elsewhere (an object is written whole, by one writer)."""
    return loc.local_path()


@contextmanager
def uploaded(loc: Location, local: Path) -> Iterator[None]:
    """The plainest ``publishing`` for :meth:`Location.written_here`: once the block ends cleanly, the file written
    at ``local`` becomes ``loc``'s object (a directory: each file under its relative name), replaced whole."""
    yield None
    if local.is_dir():
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            loc.write(path.relative_to(local).as_posix(), path)
    else:
        loc.parent().write(base_name(loc), local)


@contextmanager
def as_local_file(loc: Location) -> Iterator[str | os.PathLike[str]]:
    """``loc``, naming one object, as a local file for the readers that take a file: where it is local, itself;
    else a copy fetched whole from the location above, checked for its size and removed after the block.
    ``FileNotFoundError`` when there is no such object; ``OSError`` for a copy of another size."""
    with loc.written_here(partial(_fetched, loc)) as (local, _):
        yield local


@contextmanager
def _fetched(loc: Location, local: Path) -> Iterator[None]:
    above, name = loc.parent(), base_name(loc)
    size = above.size(name)
    if size is None:
        raise FileNotFoundError(f"{above / name}: no such object")  # (the object's URL)
    above.download(name, local, size=size)
    if local.stat().st_size != size:
        raise OSError(f"{above}/{name}: downloaded {local.stat().st_size} of {size} bytes")
    yield None
