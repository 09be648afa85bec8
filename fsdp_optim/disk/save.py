"""The save protocol, written once: :class:`Writer` (the steps at one location, one class per way of committing) and
:func:`saving` (the one driver, a context manager every save runs in). Where does a save become visible? At
:meth:`Save.commit`, the one call to :meth:`Writer.commit`.

A save, in this order (a job's ranks, a team's processes, or one process)::

    rank 0       begun = writer.begin(purpose=..., overwrite=...)   refuse foreign content (:func:`refuse_foreign`),
                                                                    note what the commit replaces
    every rank   with saving(writer, begun, save_id=..., rank=r, agreed=step) as save:
                     ... write this rank's files into save.staging.path (fsynced if save.staging.durable) ...
                     save.publish(names)              make them the location's (in place, moved, or uploaded)
                     save.commit(data, keep=names)    the commit point, on every rank, agreed: ``data`` (the commit
                                                      object's bytes) on the rank that commits, ``None`` elsewhere
                 # leaving the block: writer.finish (the replaced checkpoint's files removed, the save released);
                 # after a failure writer.abort (the save released, this rank's uploads removed); the staging
                 # directory removed either way

Three writers, one per way of committing:

- :class:`Writer` (here): a conditional put, for an object store and any backend of
  :class:`~fsdp_optim.disk.byte_io.ByteIO` primitives: the prefix listed at ``begin`` (the commit object's etag
  noted), each rank's files staged in ``$TMPDIR`` and uploaded, the commit object put only if its etag is still the
  one found, then the claimed objects older than this save's own files removed. Why that is safe: a writer that
  began before this save's first upload read the old commit object's etag (or none), so its commit fails after this
  one; a writer that begins later uploads later. Only a doomed writer's files can be older; a live writer's never
  are. A foreign object is never deleted.
- :class:`~fsdp_optim.disk.local_directory.RenameWriter`: a local directory's, a rename under its lock and journal.
- :class:`~fsdp_optim.job.node_memory.MemoryWriter`: the memory tier's, whose commit alone differs (a collective).

``disk/`` knows no format: what a save's output owns comes from the format as :class:`SaveRules`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fsdp_optim.disk.byte_io import ByteIO, listed_etag
from fsdp_optim.disk.errors import CommitOutcomeUnknown
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.text import escape
from fsdp_optim.disk.untrusted import describe_file

__all__ = [
    "Begun",
    "Claims",
    "ForeignOutputError",
    "Save",
    "SaveRules",
    "Staging",
    "Survey",
    "Writer",
    "refuse_foreign",
    "saving",
    "surveyed",
]

Agreed = Callable[[str], AbstractContextManager[None]]  # a step every process runs and agrees on (one process: none)


@dataclass(frozen=True)
class Survey:
    """What a format finds in an existing output directory."""

    replaces: frozenset[str] = frozenset()  # names a new commit there makes obsolete (removed after it)
    known: frozenset[str] = frozenset()  # names that are not foreign (the rest is refused without overwrite)
    problem: str | None = None  # why it cannot simply be written over (refused without overwrite)
    overwrite_means: str = "write there anyway (nothing there is deleted)"
    refused: str | None = None  # why it is refused even with overwrite (a foreign file the commit would replace)
    stale: frozenset[str] = frozenset()  # an interrupted write's files: not foreign, no output; the commit removes them


class Claims(Protocol):
    """What a format owns in an output, so its writer can refuse, replace and recover (a killed save's files)."""

    def survey(self, directory: Path) -> Survey:
        """The existing directory as this format sees it."""

    def created(self, entry: JournalEntry) -> set[str]:
        """Names that the write journaled as ``entry`` creates (temporary files of these go too)."""

    def tagged(self, entry: JournalEntry) -> set[tuple[str, str]]:
        """``(name, tag)`` of files the write journaled as ``entry`` saves with a tagged temporary file."""

    def referenced(self, directory: Path) -> set[str] | None:
        """Names the committed output in ``directory`` uses (kept by a recovery); ``None``: unreadable."""

    def deletable(self, name: str) -> bool:
        """Whether a recorded name may be deleted at all (a shape check: never a name this format can't make)."""


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
    listed: Callable[[ByteIO, int | None], frozenset[str]]

    @property
    def tag(self) -> str:
        """The save's short tag (its temporary files carry it, so a killed save's are recognised)."""
        return (self.entry.save_id or "")[:12]


@dataclass(frozen=True)
class Begun:
    """What rank 0 holds between :meth:`Writer.begin` and the end of the save: the commit object's etag as found
    (``None``: none there), the names the checkpoint there lists (removed once this save's commit replaced them), and
    ``release(failed)``: what ends a hold that journaled the save (a local directory's lock; ``None`` where nothing
    is held and killed writers' files are found by their age)."""

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


class ForeignOutputError(FileExistsError):
    """The output holds what fsdp_optim did not write (a foreign manifest, other files); writing
    there needs ``overwrite=True`` (``--overwrite``), and even then nothing foreign is deleted."""


def refuse_foreign(
    where: object, foreign: Sequence[str], *, overwrite: bool, problem: str | None = None,
    overwrite_means: str = "write there anyway (nothing there is deleted)",
) -> None:  # fmt: skip
    """The foreign-content rule of every writer: content of an output that its format does not claim (``foreign``,
    sorted), or a ``problem`` with what is there, is refused with ``ForeignOutputError`` unless ``overwrite``; it
    is never deleted either way."""
    if not (foreign or problem) or overwrite:
        return
    parts = [problem] if problem else []
    if foreign:
        shown = ", ".join(escape(n, limit=80) for n in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        parts.append(f"it holds files that are not an fsdp_optim checkpoint's: {shown}{more}")
    raise ForeignOutputError(f"{where}: {'; '.join(parts)}; pass overwrite=True (--overwrite) to {overwrite_means}")


def surveyed(directory: Path, claims: Claims, *, overwrite: bool, replace: bool) -> frozenset[str]:
    """A local output directory under the foreign-content rule, as its format's ``claims`` survey it: the names a
    commit there replaces and the stale files it removes. Foreign content is refused unless ``overwrite`` (and kept
    either way); ``replace=False``: an output of the format already there is refused too, unless ``overwrite``."""
    if not os.path.lexists(directory):
        return frozenset()
    if not directory.is_dir():
        raise ForeignOutputError(f"{directory}: exists and is not a directory ({describe_file(directory)})")
    survey = claims.survey(directory)
    if survey.refused:  # the commit would replace (delete) a foreign file: never, whatever the caller allows
        raise ForeignOutputError(f"{directory}: {survey.refused}")
    foreign = sorted(set(os.listdir(directory)) - survey.known)
    refuse_foreign(directory, foreign, overwrite=overwrite, problem=survey.problem,
                   overwrite_means=survey.overwrite_means)  # fmt: skip
    if survey.replaces and not replace and not overwrite:
        raise ForeignOutputError(
            f"{directory}: already holds a checkpoint ({len(survey.replaces)} of its files, e.g. "
            f"{sorted(survey.replaces)[0]}); pass overwrite=True (--overwrite) to replace it"
        )
    return survey.replaces | survey.stale


class Writer:
    """A save's steps at ``location`` under a format's ``rules``: the interface, and an object store's protocol (a
    conditional put; the module docstring). Another way of committing overrides the steps where it differs."""

    def __init__(self, location: ByteIO, rules: SaveRules) -> None:  # noqa: D107 - see the class
        self.location, self.rules = location, rules

    def begin(self, *, purpose: str, overwrite: bool) -> Begun:  # noqa: ARG002 - nothing held here
        """Rank 0, before any rank writes: refuse foreign content (unless ``overwrite``) and a commit object that is
        not the format's; note its etag and the names the checkpoint there lists. Here from one listing."""
        rules, listing = self.rules, self.location.listing()
        foreign = sorted(n for n in listing if n not in rules.known and not rules.claims.deletable(n))
        refuse_foreign(self.location, foreign, overwrite=overwrite, overwrite_means="write beside them")
        committed = listing.get(rules.commit_name)  # its version and size from the listing: nothing asked again
        replaced: frozenset[str] = frozenset()
        if committed is not None:
            try:
                replaced = rules.listed(self.location, committed.size)
            except (ValueError, OSError) as exc:
                raise ForeignOutputError(
                    f"{self.location}: its {rules.commit_name} is not an fsdp_optim manifest ({exc}); the commit "
                    "would replace it, so it is refused even with overwrite (move or delete it yourself)"
                ) from None
        return Begun(listed_etag(committed), replaced)

    def stage(self, save_id: str, rank: int) -> Staging:
        """Here a scratch directory in ``$TMPDIR``, nothing fsynced there."""
        path = Path(tempfile.mkdtemp(prefix=f"fsdp_optim-{save_id[:8]}-rank{rank}-"))
        return Staging(path, durable=False, scratch=True)

    def publish(self, staging: Staging, names: Iterable[str]) -> None:
        """Here each uploaded, then removed."""
        for name in names:
            self.location.write(name, staging.path / name)
            (staging.path / name).unlink()

    def commit(self, begun: Begun | None, data: bytes | None) -> None:
        """The commit point, called on every process once every process's files are published: ``data``, where this
        process commits (``None`` elsewhere: nothing to do here), becomes the commit object only if the location is
        still as ``begin`` found it (``begun``; ``None``: a save not begun, only if there is none)."""
        if data is not None:
            replaces = begun.replaces if begun is not None else None
            self.location.commit(self.rules.commit_name, data, replaces=replaces)

    def finish(self, begun: Begun | None, *, keep: frozenset[str]) -> None:
        """After the commit, where the save was begun: remove the replaced checkpoint's files and the claimed
        objects older than this save's own (``keep``: what the commit lists). A failure only warns (the next save
        retries); nothing is held here to release."""
        if begun is None:
            return
        try:
            claims, listing = self.rules.claims, self.location.listing()
            times = [listing[n].mtime for n in keep if n in listing]
            oldest = min((t for t in times if t is not None), default=float("-inf"))
            self.location.delete([n for n, o in listing.items() if claims.deletable(n) and n not in keep and (
                n in begun.replaced_files or (o.mtime is not None and o.mtime < oldest))])  # fmt: skip
        except OSError as exc:
            warnings.warn(f"{self.location}: could not remove the files of the checkpoint it replaced or of failed "
                          f"saves ({exc}); the next save removes them", stacklevel=2)  # fmt: skip

    def abort(self, begun: Begun | None, staging: Staging, names: Sequence[str]) -> None:
        """After a failure: release what was begun (``begun``: rank 0's) and remove what this process published
        (``names``; best effort: the next save's :meth:`finish` removes the rest)."""
        if begun is not None and begun.release is not None:
            begun.release(True)
        if not staging.scratch or not names:
            return
        try:
            self.location.delete(names)
        except OSError as exc:
            warnings.warn(f"{self.location}: could not remove this failed save's files ({exc}); the next save "
                          "removes them", stacklevel=2)  # fmt: skip


class Save:
    """One process's part of a save, as :func:`saving` hands it to its block; its staging is made at first use."""

    def __init__(self, writer: Writer, begun: Begun | None, save_id: str, rank: int, agreed: Agreed,
                 staging: Staging | None) -> None:  # fmt: skip  # noqa: D107 - see the class
        self.writer, self.begun, self.agreed = writer, begun, agreed
        self._where, self._staging = (save_id, rank), staging
        self.published: list[str] = []
        self.keep: frozenset[str] = frozenset()
        self.committed = False

    @property
    def staging(self) -> Staging:
        if self._staging is None:
            self._staging = self.writer.stage(*self._where)
        return self._staging

    def begin(self, *, purpose: str, overwrite: bool) -> Begun:
        """:meth:`Writer.begin`, where one process begins the save within the block (once; an upload that starts
        while the output is still being written)."""
        if self.begun is None:
            self.begun = self.writer.begin(purpose=purpose, overwrite=overwrite)
        return self.begun

    def publish(self, names: Sequence[str]) -> None:
        self.published += names  # (before publishing: a failure part way removes what went up)
        self.writer.publish(self.staging, names)

    def commit(self, data: bytes | None, *, keep: Iterable[str] = ()) -> None:
        """Where the save becomes visible: :meth:`Writer.commit` on every process, agreed (``data`` where this
        process commits; ``keep``: the names the commit lists)."""
        with self.agreed("the commit failed, nothing was committed"):
            self.writer.commit(self.begun, data)
        self.keep, self.committed = frozenset(keep), True

    def end(self, failure: BaseException | None) -> None:
        """The driver's last step: :meth:`Writer.finish` after the commit (an interrupt after it too: the save
        stands), else :meth:`Writer.abort` (what this process published is kept when the commit's outcome is
        unknown); the scratch staging removed either way."""
        try:
            if self.committed:
                self.writer.finish(self.begun, keep=self.keep)
                if failure is not None:
                    note = f"(the save into {self.writer.location} had committed before this interrupt: it is whole)"
                    getattr(failure, "add_note", lambda _: None)(note)
            else:
                kept = isinstance(failure, CommitOutcomeUnknown)  # (the commit may list them)
                self.writer.abort(self.begun, self._staging or _NOWHERE, () if kept else self.published)
        finally:
            if self._staging is not None and self._staging.scratch:
                shutil.rmtree(self._staging.path, ignore_errors=True)


_NOWHERE = Staging(Path(), durable=False, scratch=False)  # a process that never staged: nothing of its own to remove


def _alone(what: str) -> AbstractContextManager[None]:  # noqa: ARG001 - one process: nothing to agree
    return nullcontext()


@contextmanager
def saving(
    writer: Writer, begun: Begun | None, *, save_id: str, rank: int = 0, agreed: Agreed = _alone,
    staging: Staging | None = None,
) -> Iterator[Save]:  # fmt: skip
    """The one driver of a save (the module docstring); ``staging``: one given, already there; ``agreed(what)``: the
    step every process runs and agrees on (a job's, a team's; one process: none)."""
    save = Save(writer, begun, save_id, rank, agreed, staging)
    try:
        yield save
    except BaseException as exc:
        save.end(exc)
        raise
    save.end(None)
