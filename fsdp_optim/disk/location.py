"""Where a checkpoint's files live: one interface, :class:`Location`, and one class per backend.

A backend is a directory-like place holding named objects: :class:`~fsdp_optim.disk.local_directory.LocalDirectory`
(a local directory: rename and a lock), :class:`~fsdp_optim.disk.storage.ObjectStore` (a prefix of any fsspec
filesystem: S3, GCS, ``memory://``...; a conditional put), :class:`~fsdp_optim.job.node_memory.NodeMemory` (the
memory tier: a step in a node's tmpfs, committed by replicas and markers, its missing ranges received from peers;
in ``job/``, as its commit and prefetch are collectives). Readers and writers above ``disk/`` take a ``Location`` and
call these methods; none asks which kind it is.

A backend implements the eight byte-level primitives of :class:`~fsdp_optim.disk.byte_io.ByteIO` (its name, the
level below, listing, ranged reads into buffers, an atomic whole-object write, the conditional commit, delete); its
sizes, whole reads and copies follow from them there. Beyond them: ``prefetch(spans)`` (ranges fetched ahead of a
load), ``local_path()`` (the path whose files are mapped in place, or None), ``present()`` / ``non_objects()``; an
output of any shape written by ``written_here(publishing)`` (in place where it is local, else a local copy published
as the block ends; the plainest publishing: ``uploaded``); a whole location removed under ``guarded(purpose)``: its
objects deleted, then ``remove_marker()``.

A save, in this order (a job's ranks, or one process), written once here on those primitives::

    rank 0       begun = location.begin_save(rules, purpose=..., overwrite=...)   refuse foreign content, note what
                                                                                  the commit replaces
    every rank   into = location.stage(save_id, rank)     a local directory to write this rank's own files into
                 ... write them into into.path (fsynced if into.durable) ...
                 location.publish(into, names)             make them the location's (in place, or uploaded)
    rank 0       location.commit_manifest(rules, begun, data)     the commit point, last (rename | conditional put)
    every rank   location.finish_save(begun, failed=False, keep=...)   once all agreed; rank 0 (``begun``, None
                                                                        elsewhere) removes what the replaced
                                                                        checkpoint left and releases the save
    after a failure: rank 0 location.finish_save(begun, failed=True); every rank location.discard(into, names)
    every rank   location.unstage(into) always

The defaults are an object store's protocol (:mod:`~fsdp_optim.disk.store_save` says why it is safe): the prefix
listed at ``begin_save`` (foreign objects refused, the commit object's etag noted), each rank's files staged in
``$TMPDIR`` and uploaded, the manifest committed by the conditional ``commit`` on that etag, then the replaced
checkpoint's files and the claimed objects older than this save's own removed. A backend that does better overrides
the hook where it differs: a local directory stages in place (``stage``), takes its lock and journals the save
(``begin_save``; ``Begun.release`` closes the journal) and renames its manifest into place (``commit_manifest``);
the memory tier's commit is its ``finish_save``, a collective.

``disk/`` knows no format: what a save's output owns comes from the format as :class:`SaveRules`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fsdp_optim.disk.byte_io import ByteIO
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.locks import ForeignOutputError
from fsdp_optim.disk.staged import Claims
from fsdp_optim.disk.store_policy import RetryPolicy

if TYPE_CHECKING:
    from fsdp_optim.disk.multipart import Multipart

__all__ = ["Begun", "Location", "ObjectPath", "SaveRules", "Staging", "Where", "is_url"]

T = TypeVar("T")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    """``path`` names an object store or another backend by URL (a scheme other than ``file://``), not a local
    path."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


@dataclass(frozen=True)
class SaveRules:
    """What a format tells a location about a save: ``claims`` (what an output of it owns), ``entry`` (the journal
    entry announcing the save: its id and world size), ``commit_name`` (the object written last, the commit point),
    ``known`` (names that are never foreign: the format's manifests), and ``listed(location, size)``: the names the
    committed checkpoint there lists (replaced by the commit; ``size``: its commit object's, as listed), raising
    ``ValueError``/``OSError`` when it is not the format's."""

    claims: Claims
    entry: JournalEntry
    commit_name: str
    known: frozenset[str]
    listed: Callable[[Location, int | None], frozenset[str]]

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


@dataclass(frozen=True)
class Begun:
    """What rank 0 holds between :meth:`Location.begin_save` and :meth:`Location.finish_save`: the save's rules, the
    commit object's etag as found (``None``: none there), the names the checkpoint there lists (removed once this
    save's manifest replaced them), and ``release(failed)``: what ends a hold that journaled the save (a local
    directory's lock; ``None`` where nothing is held and killed writers' files are found by their age)."""

    rules: SaveRules
    replaces: str | None
    replaced_files: frozenset[str] = frozenset()
    release: Callable[[bool], None] | None = None


@dataclass(frozen=True)
class Staging:
    """The local directory a rank writes its own files into; whether they must be made durable there (in place
    in a local directory: yes; staged for an upload: no, the store's copy is what lasts); and whether it is a
    ``scratch`` directory apart from the location (published by upload, removed after) rather than the location."""

    path: Path
    durable: bool
    scratch: bool


class Location(ByteIO):
    """A place holding a checkpoint's files (see the module docstring for the call order of a save)."""

    policy: RetryPolicy

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

    # -- saving: the steps, written once on the primitives (an object store's protocol by default) --------------

    def begin_save(self, rules: SaveRules, *, purpose: str, overwrite: bool) -> Begun:  # noqa: ARG002 - no lock here
        """Rank 0, before any rank writes: refuse foreign content (unless ``overwrite``: it is then left alone, never
        deleted) and a commit object that is not the format's; note its etag for the commit and the names the
        checkpoint there lists (the commit replaces them). Here from one listing, holding nothing; a local directory
        takes its lock and journals the save instead."""
        listing = self.listing()
        foreign = sorted(n for n in listing if n not in rules.known and not rules.claims.deletable(n))
        if foreign and not overwrite:
            raise ForeignOutputError(
                f"{self}: holds objects that are not an fsdp_optim checkpoint's ({', '.join(foreign[:5])}"
                f"{'...' if len(foreign) > 5 else ''}); write elsewhere, or pass overwrite=True to write beside them "
                "(they are never deleted)"
            )
        replaced: frozenset[str] = frozenset()
        committed = listing.get(rules.commit_name)  # its version and size from the listing: nothing asked again
        etag = self.listed_etag(committed)
        if committed is not None:
            try:
                replaced = rules.listed(self, committed.size)
            except (ValueError, OSError) as exc:
                raise ForeignOutputError(
                    f"{self}: its {rules.commit_name} is not an fsdp_optim manifest ({exc}); the commit would replace "
                    "it, so it is refused even with overwrite (move or delete it yourself)"
                ) from None
        return Begun(rules, etag, replaced)

    def stage(self, save_id: str, rank: int) -> Staging:
        """Where this rank writes its own files: here a scratch directory in ``$TMPDIR``, nothing fsynced there,
        uploaded by :meth:`publish` and removed by :meth:`unstage` (a local directory: itself, in place)."""
        path = Path(tempfile.mkdtemp(prefix=f"fsdp_optim-{save_id[:8]}-rank{rank}-"))
        return Staging(path, durable=False, scratch=True)

    def publish(self, staging: Staging, names: Iterable[str]) -> None:
        """Make the files ``names`` written into ``staging`` this location's: from a scratch directory each is
        uploaded, then removed there; nothing to do where they were written in place."""
        for name in names if staging.scratch else ():
            self.upload(staging.path / name, name)
            (staging.path / name).unlink()

    def commit_manifest(self, rules: SaveRules, begun: Begun | None, data: bytes) -> None:
        """Rank 0: write the commit point (``rules.commit_name``) last, only if the location is still as
        :meth:`begin_save` found it (``begun``; ``None``: a save into a location of its own, not begun: only if
        there is none). Here the conditional :meth:`~fsdp_optim.disk.byte_io.ByteIO.commit` on the etag found."""
        self.commit(rules.commit_name, data, replaces=begun.replaces if begun is not None else None)

    def finish_save(self, begun: Begun | None, *, failed: bool, keep: frozenset[str] = frozenset()) -> None:
        """Every rank, after every rank agreed: the save rank 0 began (``begun``; ``None`` on the other ranks and for
        a save not begun: nothing to do) is released, a committed one first removing the files of the checkpoint it
        replaced and what failed writers left that its manifest does not list (``keep``; :meth:`tidy`)."""
        if begun is None:
            return
        try:
            if not failed:
                self.tidy(begun, keep)
        finally:
            if begun.release is not None:
                begun.release(failed)

    def discard(self, staging: Staging, names: Iterable[str]) -> None:
        """After a failed save: remove what this rank published (best effort: the next save's :meth:`tidy` removes
        the rest); nothing where its files were written in place (the save's journal removes them)."""
        if not staging.scratch:
            return
        try:
            self.delete(names)
        except OSError as exc:
            warnings.warn(f"{self}: could not remove this failed save's files ({exc}); the next save removes them",
                          stacklevel=2)  # fmt: skip

    def unstage(self, staging: Staging) -> None:
        """Remove the staging directory where it is a scratch directory (never the location itself)."""
        if staging.scratch:
            shutil.rmtree(staging.path, ignore_errors=True)

    def tidy(self, begun: Begun, keep: frozenset[str]) -> list[str]:
        """After a commit: remove the files of the checkpoint it replaced that the new manifest does not list
        (``keep``) and, where no journal recorded the saves (``begun.release`` is ``None``: a store), the claimed
        objects older than this save's own files (:mod:`~fsdp_optim.disk.store_save` says why that is safe). Returns
        the names removed; a failure only warns (the next save retries)."""
        claims = begun.rules.claims
        try:
            if begun.release is not None:  # journaled: a killed writer's files were removed when this save began
                stale = sorted(n for n in begun.replaced_files - keep if claims.deletable(n))
            else:
                listing = self.listing()
                times = [listing[n].mtime for n in keep if n in listing]
                oldest = min((t for t in times if t is not None), default=float("-inf"))
                stale = [
                    n
                    for n, o in listing.items()
                    if claims.deletable(n)
                    and n not in keep
                    and (n in begun.replaced_files or (o.mtime is not None and o.mtime < oldest))
                ]
            self.delete(stale)
            return stale
        except OSError as exc:
            warnings.warn(f"{self}: could not remove the files of the checkpoint it replaced or of failed saves "
                          f"({exc}); the next save removes them", stacklevel=2)  # fmt: skip
            return []

    # -- what it can do (asked by name of the capability, never of the backend) ------------------------------

    def shared_by_processes(self) -> bool:
        """Whether several processes may write one output here together: each its own files, or its own byte
        ranges of one file, all landing in the one place every process sees (a local directory of a file system
        they share; ``os.fspath`` of it is then its path). ``False`` by default: an object is written whole, by one
        writer."""
        return False

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
