"""Where a checkpoint's files live: one interface, :class:`Location`, and one class per backend.

A backend is a directory-like place holding named objects: :class:`~fsdp_optim.disk.local_directory.LocalDirectory`
(a local directory: rename and a lock), :class:`~fsdp_optim.disk.storage.ObjectStore` (a prefix of any fsspec
filesystem: S3, GCS, ``memory://``...; a conditional put), :class:`~fsdp_optim.job.node_memory.NodeMemory` (the
memory tier: a step in a node's tmpfs, committed by replicas and markers, its missing ranges received from peers;
in ``job/``, as its commit and prefetch are collectives). Readers and writers above ``disk/`` take a ``Location`` and
call these methods; none asks which kind it is.

A backend implements the eight byte-level primitives of :class:`~fsdp_optim.disk.byte_io.ByteIO` (its name, the
level below, listing, ranged reads into buffers, an atomic whole-object write, the conditional commit, delete); its
sizes, whole reads and copies follow from them there. Beyond them: naming (``/``, ``child``, ``parent``,
``identity``), ``prefetch(spans)`` (ranges fetched ahead of a load), ``local_path()`` (the path whose files are mapped
in place, or None), ``present()`` / ``non_objects()``; an output of any shape written by ``written_here(publishing)``
(in place where it is local, else a local copy published as the block ends; the plainest publishing: ``uploaded``);
a whole location removed under ``guarded(purpose)``: its objects deleted, then ``remove_marker()``; and
``writer(rules)``: how a save commits here (:mod:`fsdp_optim.disk.save`, the one save protocol: a conditional put by
default, a rename under a lock and journal in a local directory).

``disk/`` knows no format: what a save's output owns comes from the format (:class:`~fsdp_optim.disk.save.SaveRules`).
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
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fsdp_optim.disk.byte_io import ByteIO
from fsdp_optim.disk.save import SaveRules, Writer

if TYPE_CHECKING:
    from fsdp_optim.disk.multipart import Multipart

__all__ = ["Location", "ObjectPath", "Where", "is_url"]

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
    def child(self, name: str) -> Location:
        """The location ``name`` below this one (a step directory under a manager's root)."""

    @property
    def name(self) -> str:
        return str(self).rstrip("/").rsplit("/", 1)[-1]

    def public(self) -> Path | Location:
        """What the API hands back for this location (a ``Path`` for a local directory, as it always has)."""
        return self

    def local_path(self) -> Path | None:
        """The local path this location is, for the readers that map or open its files in place; ``None`` where its
        objects have no local path (a store: read by ranges, written by uploads)."""
        return None

    def identity(self) -> str:
        """A name that says which location this is in any process (a URL, a local directory's absolute path)."""
        return str(self)

    def parent(self) -> Location:
        """The location this one is directly below (of an object's URL: the prefix holding it)."""
        raise NotImplementedError(f"{self}: no parent location")

    # -- reading -------------------------------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether there is a place here to list (a store's prefix always is: it exists once an object does)."""
        return True

    def present(self) -> bool:
        """Whether this location is there now as a place of its own: by default while an object is below it (a
        store may keep an emptied prefix listed by its marker: not present); a local directory while it exists,
        even empty."""
        return bool(self.listing())

    def non_objects(self) -> list[str]:
        """The names directly under this location that are not objects (a local directory's subdirectories, links,
        devices: never a checkpoint's own files), sorted; none by default (a store's listing is all objects)."""
        return []

    def prefetch(
        self, spans: Callable[[], Sequence[Any]]  # noqa: ARG002 - nothing fetched ahead by default
    ) -> AbstractContextManager[Mapping[str, Sequence[Any]] | None]:
        """The byte ranges ``spans()`` lists (objects ``.file``, bytes ``[.start, .stop)``, read ``.uses`` times),
        fetched ahead of their use within the block: their pieces by object name (each with ``bytes()``,
        ``used()``), or ``None`` where nothing is fetched ahead (a local directory maps its files; ``spans`` is then
        not called)."""
        return nullcontext(None)

    # -- writing and removing ------------------------------------------------------------------------------

    def guarded(self, *, purpose: str) -> AbstractContextManager[bool]:  # noqa: ARG002 - no lock by default
        """Held while this location is emptied and removed: ``False`` when a writer holds it (then nothing may be
        removed), else ``True``. A local directory takes its lock (``purpose`` says why, to a second writer); a
        store has none to take."""
        return nullcontext(True)

    @contextmanager
    def written_here(
        self, publishing: Callable[[Path], AbstractContextManager[T]]
    ) -> Iterator[tuple[str | os.PathLike[str], T | None]]:
        """A local path at which to write an output for this location (a file or a directory of its name), and what
        ``publishing(local)`` yields: here a scratch copy in ``$TMPDIR``, entered in ``publishing(local)`` (which
        refuses, uploads, commits or removes its uploads as the block ends) and removed however it ends. A local
        directory is written in place: its path as it was given, and ``None`` (``publishing`` is not called)."""
        scratch = Path(tempfile.mkdtemp(prefix="fsdp_optim-out-"))
        try:
            local = scratch / self.name
            with publishing(local) as published:
                yield local, published
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    @contextmanager
    def uploaded(self, local: Path) -> Iterator[None]:
        """The plainest ``publishing`` for :meth:`written_here`: once the block ends cleanly, the file written at
        ``local`` becomes this location's object (a directory: each file under its relative name), replaced whole."""
        yield None
        if local.is_dir():
            for path in sorted(p for p in local.rglob("*") if p.is_file()):
                self.upload(path, path.relative_to(local).as_posix())
        else:
            self.parent().upload(local, self.name)

    def remove_marker(self) -> None:  # noqa: B027 - most backends keep no marker
        """Once its objects are deleted, remove what keeps this location listed (a store's "directory" object, a
        local directory itself; nothing by default)."""

    # -- what it can do (asked by name of the capability, never of the backend) ------------------------------

    def writer(self, rules: SaveRules) -> Writer:
        """How a save under ``rules`` commits here (:mod:`fsdp_optim.disk.save`): by default a conditional put of
        the commit object, on the :class:`~fsdp_optim.disk.byte_io.ByteIO` primitives."""
        return Writer(self, rules)

    def shared_directory(self) -> Path | None:
        """The directory of a file system every process sees, where several processes may write one output
        together (each its own files, or its own byte ranges of one file); ``None`` by default: an object is
        written whole, by one writer."""
        return None

    def multipart(self, name: str) -> Multipart | None:  # noqa: ARG002 - none by default
        """Object ``name`` written as the parts of one multipart upload, by any number of processes, where the
        backend offers it (:mod:`~fsdp_optim.disk.multipart`); ``None`` by default (written whole, by one writer)."""
        return None

    def same_place(self, other: Location) -> bool:
        """Whether ``other`` names this very location (by default: the same :meth:`identity`)."""
        return self.identity() == other.identity()

    @contextmanager
    def as_local_file(self) -> Iterator[str | os.PathLike[str]]:
        """This location, naming one object, as a local file for the readers that take a file (a full dict, a
        consolidated checkpoint): by default the object fetched whole from the location above
        (:meth:`fetched_whole`, removed after the block; ``FileNotFoundError`` when there is none)."""
        with self.parent().fetched_whole(self.name) as local:
            yield local



Where = Path | Location  # a checkpoint directory as the readers hold it (local files mapped, or ranged reads)
