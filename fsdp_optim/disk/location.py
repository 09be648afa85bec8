"""Where a checkpoint's files live: one interface, :class:`Location`, and one class per backend.

A backend is a directory-like place holding named objects: :class:`~fsdp_optim.disk.local_directory.LocalDirectory`
(a local directory: rename and a lock), :class:`~fsdp_optim.disk.storage.ObjectStore` (a prefix of any fsspec
filesystem: S3, GCS, ``memory://``...; a conditional put), :class:`~fsdp_optim.job.node_memory.NodeMemory` (the
memory tier: a step in a node's tmpfs, committed by replicas and markers, its missing ranges received from peers;
in ``job/``, as its commit and prefetch are collectives). Readers and writers above ``disk/`` take a ``Location`` and
call these methods; none asks which kind it is. A new backend (a local NVMe tier, a store with another commit rule)
is one subclass (a store's: of :class:`~fsdp_optim.disk.store_save.StoreSaving`), and one test parameter.

Reading::

    listing() / prefixes() / size(name)       what is there now (never cached)
    read_range(name, a, b) / read_into(...)   byte ranges (retried and bounded by ``policy`` where that means anything)
    read_all(name, limit=...)                 a small object whole (a manifest)
    fetched_whole(name)                       an object whole as a local file, for the readers that take a file
                                              (its own file, or a temporary copy: ``download(name, local)``)
    local_path()                              the local path whose files are mapped in place, or None (a store)
    present() / non_objects()                 there as a place of its own now; names below that are no objects

Writing an object whole: ``upload(local, name)``, ``put(name, data)``; an output of any shape:
``written_here(publishing)`` (in place where it is local, else a local copy published as the block ends; the plainest
publishing: ``uploaded``). Removing: ``delete(names)``; a whole location, under ``guarded(purpose)``: its objects
deleted, then ``remove_marker()``.

A save, in this order (a job's ranks, or one process)::

    rank 0       begun = location.begin_save(rules, purpose=..., overwrite=...)   refuse foreign content, note what
                                                                                  the commit replaces
    every rank   into = location.stage(save_id, rank)     a local directory to write this rank's own files into
                 ... write them into into.path (fsynced if into.durable) ...
                 location.publish(into, names)             make them the location's (in place, or uploaded)
    rank 0       location.commit_manifest(rules, begun, data)     the commit point, last (rename | conditional put)
    rank 0       location.finish_save(begun, failed=..., keep=...)   release, remove what a failed save or the
                                                                      replaced checkpoint left
    every rank   location.discard(names) after a failure; location.unstage(into) always

``disk/`` knows no format: what a save's output owns comes from the format as :class:`SaveRules`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.staged import Claims
from fsdp_optim.disk.store_policy import RetryPolicy

__all__ = ["Begun", "Location", "ObjectPath", "SaveRules", "Staging", "StoredObject", "Where", "is_url"]

T = TypeVar("T")
_DOWNLOAD_PIECE = 16 << 20  # bytes a default download reads at a time
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    """``path`` names an object store or another backend by URL (a scheme other than ``file://``), not a local
    path."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


@dataclass(frozen=True)
class StoredObject:
    """One object directly under a location: its name (relative), size, modification time and etag (if any)."""

    name: str
    size: int
    mtime: float | None
    etag: str | None


@dataclass(frozen=True)
class SaveRules:
    """What a format tells a location about a save: ``claims`` (what an output of it owns), ``entry`` (the journal
    entry announcing the save: its id and world size), ``commit_name`` (the object written last, the commit point),
    ``known`` (names that are never foreign: the format's manifests), and ``listed(location)``: the names the
    committed checkpoint there lists (replaced by the commit), raising ``ValueError``/``OSError`` when it is not
    the format's."""

    claims: Claims
    entry: JournalEntry
    commit_name: str
    known: frozenset[str]
    listed: Callable[[Location], frozenset[str]]

    @property
    def tag(self) -> str:
        """The save's short tag (its temporary files carry it, so a killed save's are recognised)."""
        return (self.entry.save_id or "")[:12]


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


class Begun:
    """What rank 0 holds between :meth:`Location.begin_save` and :meth:`Location.finish_save` (each backend's own)."""


@dataclass(frozen=True)
class Staging:
    """The local directory a rank writes its own files into, and whether they must be made durable there (in place
    in a local directory: yes; staged for an upload: no, the store's copy is what lasts)."""

    path: Path
    durable: bool


class Location(ABC):
    """A place holding a checkpoint's files (see the module docstring for the call order of a save)."""

    policy: RetryPolicy

    # -- naming --------------------------------------------------------------------------------------------

    @abstractmethod
    def __str__(self) -> str: ...

    @abstractmethod
    def __truediv__(self, name: str) -> Path | ObjectPath:
        """Object ``name`` as shown to a user (a ``Path``, or an ``ObjectPath`` that prints as its URL)."""

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

    @abstractmethod
    def listing(self) -> dict[str, StoredObject]:
        """The objects (regular files) directly under this location, by name; {} when there is none."""

    @abstractmethod
    def prefixes(self) -> list[str]:
        """The names of the locations directly below this one, sorted."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Object ``name``'s size, ``None`` when there is none."""

    def read_range(self, name: str, start: int, stop: int) -> bytes | bytearray:
        """Bytes ``[start, stop)`` of object ``name`` (``FileNotFoundError`` when absent); by default one
        :meth:`read_into` a new buffer (a store overrides it with its own ranged GET)."""
        out = bytearray(max(stop - start, 0))
        self.read_into(name, start, [memoryview(out)])
        return out

    @abstractmethod
    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None:
        """Fill ``targets`` (writable buffers tiling the object's bytes from ``start`` on, in order)."""

    def prefetch(
        self, spans: Callable[[], Sequence[Any]]  # noqa: ARG002 - nothing fetched ahead by default
    ) -> AbstractContextManager[Mapping[str, Sequence[Any]] | None]:
        """The byte ranges ``spans()`` lists (objects ``.file``, bytes ``[.start, .stop)``, read ``.uses`` times),
        fetched ahead of their use within the block: their pieces by object name (each with ``bytes()``,
        ``used()``), or ``None`` where nothing is fetched ahead (a local directory maps its files; ``spans`` is then
        not called)."""
        return nullcontext(None)

    def read_all(self, name: str, *, limit: int) -> bytes:
        """The whole object (at most ``limit`` bytes, else ``ValueError``); ``FileNotFoundError`` when absent."""
        size = self.size(name)
        if size is None:
            raise FileNotFoundError(f"{self / name}: no such object")
        if size > limit:
            raise ValueError(f"{self / name}: {size} bytes, above the bound for it ({limit})")
        return bytes(self.read_range(name, 0, size))

    @contextmanager
    def fetched_whole(self, name: str) -> Iterator[Path]:
        """Object ``name`` whole as a local file, for the readers that take a file (a full dict, a named safetensors
        file, a layout file): a temporary copy (:meth:`download`), checked for the object's size and removed after
        the block. ``FileNotFoundError`` when there is no such object; ``OSError`` for a copy of another size."""
        size = self.size(name)
        if size is None:
            raise FileNotFoundError(f"{self / name}: no such object")
        scratch = Path(tempfile.mkdtemp(prefix="fsdp_optim-in-"))
        try:
            local = scratch / name
            self.download(name, local, size=size)
            if local.stat().st_size != size:
                raise OSError(f"{self / name}: downloaded {local.stat().st_size} of {size} bytes")
            yield local
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def download(self, name: str, local: Path, *, size: int) -> None:
        """Copy object ``name`` (``size`` bytes) into the new local file ``local`` (here: by ranged reads, a piece
        at a time; a backend with a whole-object copy of its own uses that)."""
        with open(local, "wb") as out:
            for start in range(0, size, _DOWNLOAD_PIECE):
                out.write(self.read_range(name, start, min(start + _DOWNLOAD_PIECE, size)))

    # -- removing ------------------------------------------------------------------------------------------

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Remove objects ``names`` (missing ones are not an error)."""

    @abstractmethod
    def upload(self, local: Path, name: str) -> None:
        """Make the local file ``local`` this location's object ``name`` (a copy; the file stays)."""

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Write ``data`` as object ``name``, replaced whole (never seen half written)."""

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

    # -- saving --------------------------------------------------------------------------------------------

    @abstractmethod
    def begin_save(self, rules: SaveRules, *, purpose: str, overwrite: bool) -> Begun:
        """Rank 0, before any rank writes: refuse foreign content (unless ``overwrite``) and note what the commit
        will replace."""

    @abstractmethod
    def stage(self, save_id: str, rank: int) -> Staging:
        """Where this rank writes its own files."""

    def publish(self, staging: Staging, names: Iterable[str]) -> None:  # noqa: B027 - in place by default
        """Make the files ``names`` written into ``staging`` this location's (nothing to do where they were
        written in place)."""

    def discard(self, names: Iterable[str]) -> None:  # noqa: B027 - the save's journal removes them by default
        """After a failed save: remove what this rank published (best effort)."""

    def unstage(self, staging: Staging) -> None:  # noqa: B027 - nothing staged apart by default
        """Remove the staging directory if it is not the location itself."""

    @abstractmethod
    def commit_manifest(self, rules: SaveRules, begun: Begun | None, data: bytes) -> None:
        """Rank 0: write the commit point (``rules.commit_name``) last, only if the location is still as
        :meth:`begin_save` found it (``begun``; ``None``: a save into a directory of one's own, not begun)."""

    @abstractmethod
    def finish_save(self, begun: Begun, *, failed: bool, keep: frozenset[str] = frozenset()) -> None:
        """Rank 0, after every rank agreed: release the save; a failed one's files go, a committed one removes the
        files of the checkpoint it replaced that it does not list (``keep``)."""

    # -- what it can do (asked by name of the capability, never of the backend) ------------------------------

    def shared_by_processes(self) -> bool:
        """Whether several processes may write one output here together: each its own files, or its own byte
        ranges of one file, all landing in the one place every process sees (a local directory of a file system
        they share; ``os.fspath`` of it is then its path). ``False`` by default: an object is written whole, by one
        writer."""
        return False

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
