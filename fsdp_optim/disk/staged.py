"""The one way out of a local directory: every writer of fsdp_optim writes through :func:`staged_output` (a directory
of files) or :func:`write_file` (one file), or, for a save shared by the ranks of a job, :class:`RenameWriter` (the
local directory's writer of the one save protocol, :mod:`fsdp_optim.disk.save`: the same steps, with the files
written in place by every rank).

What every writer gets, whatever the format::

    out/                                   # the output (may not exist yet)
    .out.fsdp-optim.lock                   # beside it: the lock and its journal (disk/locks.py)
    .out.fsdp-optim-staging.<12 hex>/      # files are written here, then moved into out/

1. ``out`` must not be (or hold) one of ``inputs`` (:func:`check_not_input`).
2. ``out``'s lock is taken (a second writer gets ``OutputLockedError``).
3. What a killed writer of ``out`` left is removed, exactly as its journal announced it (:func:`recover`).
4. Content of ``out`` that the format does not claim is *foreign* (:func:`fsdp_optim.disk.save.refuse_foreign`):
   refused with ``ForeignOutputError`` unless ``overwrite``, and never deleted either way (a foreign file where the
   format commits, such as another tool's ``manifest.json``, is refused even with ``overwrite``: the commit would
   replace it).
5. The write is journaled before any file exists (its staging directory, the names it will create, what
   its commit replaces); the files are staged, moved in, and the format's commit runs last (our manifest).
6. A refused or failed write leaves ``out`` as it was; a killed one is cleaned up by the next writer.

A format says what is its own with a :class:`Claims` (``formats/sharded/writer.py``: our checkpoint;
``formats/fairseq``: a shard set; ``formats/dcp.py``: a DCP directory). This module knows no format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from fsdp_optim.disk.atomic import TAGGED_TEMP_NAME, TEMP_NAME, atomic_save, atomic_write, fsync_dir
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.locks import ForeignOutputError, OutputLock, lock_output, resolve_output
from fsdp_optim.disk.save import Begun, SaveRules, Staging, Writer, refuse_foreign, saving
from fsdp_optim.disk.untrusted import describe_file

if TYPE_CHECKING:
    from fsdp_optim.disk.location import Location

__all__ = [
    "Claims",
    "RenameWriter",
    "Survey",
    "Stage",
    "check_not_input",
    "close_output",
    "open_output",
    "recover",
    "staged_output",
    "staged_writer",
    "write_file",
    "write_stream",
]

STAGING_MARK = ".fsdp-optim-staging."


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
    """What a format owns in an output directory, so the one writer can refuse, replace and recover."""

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


@dataclass
class Stage:
    """An output being written: put files into ``dir``; they are moved into ``out`` when the block ends, ``last``
    last, then ``commit`` (the commit object's bytes, if the format has one) is renamed into place."""

    out: Path
    dir: Path
    last: Sequence[str] = ()  # names moved in after every other file (a format's commit point)
    commit: bytes | None = None


def check_not_input(output: str | os.PathLike[str], inputs: Iterable[Any], *, name: str = "out_dir") -> None:
    """Refuse an output that resolves (real path, or the same inode) to one of ``inputs``: a file, a
    directory (or a file in it, such as its manifest) and every file in that directory."""
    real = resolve_output(output)
    for given in inputs:
        if given is None or isinstance(given, Mapping) or not isinstance(given, (str, os.PathLike)):
            continue
        path = Path(given)
        candidates = [path]
        directory = path if path.is_dir() else path.parent if path.name.startswith("manifest.") else None
        if directory is not None:
            candidates += [directory, *directory.iterdir()]
        for candidate in candidates:
            if resolve_output(candidate) == real or _same_inode(candidate, real):
                raise ValueError(f"{name}: {output} is {candidate}, one of the inputs; write to another path")


def _same_inode(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def open_output(
    out: str | os.PathLike[str],
    claims: Claims,
    entry: JournalEntry,
    *,
    purpose: str,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
    replace: bool = True,
) -> OutputLock:
    """Steps 1-4 and the journal of step 5 for ``out``; returns the held lock, whose last journal entry is
    ``entry`` with ``replaces`` (the names the commit makes obsolete). Finish with :func:`close_output`.
    ``replace=False``: an output of this format already there is refused too, unless ``overwrite``."""
    check_not_input(out, inputs)
    lock = lock_output(out, purpose=purpose)
    try:
        if lock.previous:
            recover(lock.output, lock.previous, claims)
            lock.forget()
        replaces, stale = _owned_or_refuse(lock.output, claims, overwrite=overwrite)
        if replaces and not replace and not overwrite:
            raise ForeignOutputError(
                f"{lock.output}: already holds a checkpoint ({len(replaces)} of its files, e.g. "
                f"{sorted(replaces)[0]}); pass overwrite=True (--overwrite) to replace it"
            )
        lock.journal(dataclasses.replace(entry, replaces=tuple(sorted(replaces | stale))))
    except BaseException:
        lock.release()
        raise
    return lock


def close_output(lock: OutputLock, claims: Claims, *, failed: bool) -> None:
    """Release a lock from :func:`open_output`; if the write failed, first remove what it created."""
    try:
        if failed:
            recover(lock.output, lock.entries, claims)
    finally:
        lock.release()


def _owned_or_refuse(directory: Path, claims: Claims, *, overwrite: bool) -> tuple[set[str], set[str]]:
    """What a commit in ``directory`` replaces, and the stale files it removes; foreign content refused unless
    ``overwrite`` (kept either way)."""
    if not os.path.lexists(directory):
        return set(), set()
    if not directory.is_dir():
        raise ForeignOutputError(f"{directory}: exists and is not a directory ({describe_file(directory)})")
    survey = claims.survey(directory)
    if survey.refused:  # the commit would replace (delete) a foreign file: never, whatever the caller allows
        raise ForeignOutputError(f"{directory}: {survey.refused}")
    foreign = sorted(set(os.listdir(directory)) - survey.known)
    refuse_foreign(directory, foreign, overwrite=overwrite, problem=survey.problem,
                   overwrite_means=survey.overwrite_means)  # fmt: skip
    return set(survey.replaces), set(survey.stale)


class RenameWriter(Writer):
    """A local directory's save (:mod:`fsdp_optim.disk.save`): at ``begin`` the directory locked, what a killed writer
    left removed, foreign content refused (unless ``overwrite``; ``replace=False``: a checkpoint there too) and the
    save journaled (:func:`open_output`); the files written in place by every rank of a job, or (``staging``: its
    name) into a staging directory beside the output and moved in when published, the move journaled first; the
    commit object renamed into place last (its temporary file carries the save's tag, so the journal of a save killed
    there names it); then the replaced output's files removed and the lock released (a failed save's files removed
    first, from its journal: :func:`close_output`)."""

    def __init__(self, location: Location, rules: SaveRules, *, staging: str | None = None,
                 inputs: Iterable[Any] = (), replace: bool = True) -> None:  # fmt: skip  # noqa: D107 - see the class
        super().__init__(location, rules)
        path = location.local_path()
        assert path is not None, f"{location}: a rename needs a local directory"
        self.path, self.staging, self.inputs, self.replace = path, staging, inputs, replace
        self.lock: OutputLock | None = None  # held from begin (rank 0's) to finish or abort

    def begin(self, *, purpose: str, overwrite: bool) -> Begun:
        claims, entry = self.rules.claims, self.rules.entry
        if self.staging is not None:
            entry = dataclasses.replace(entry, staging=self.staging)
        self.lock = lock = open_output(self.path, claims, entry, purpose=purpose, inputs=self.inputs,
                                       overwrite=overwrite, replace=self.replace)  # fmt: skip
        replaced = frozenset(lock.entries[-1].replaces or ())
        return Begun(None, replaced, release=lambda failed: close_output(lock, claims, failed=failed))

    def stage(self, save_id: str, rank: int) -> Staging:  # noqa: ARG002 - one directory for every rank
        if self.staging is None:  # every rank writes in place
            self.path.mkdir(parents=True, exist_ok=True)
            return Staging(self.path, durable=True, scratch=False)
        path = self._out().parent / self.staging  # (beside the output its lock names: symlinks resolved)
        path.mkdir(mode=0o700)
        return Staging(path, durable=True, scratch=True)

    def publish(self, staging: Staging, names: Iterable[str]) -> None:
        """Written in place: nothing to do. Staged: moved in, in order (a kill from here on is undone by name)."""
        if not staging.scratch:
            return
        names, lock = list(names), self.lock
        assert lock is not None, "a staged save is published by the process that began it"
        lock.journal(dataclasses.replace(lock.entries[-1], moved=(*(lock.entries[-1].moved or ()), *names)))
        lock.output.mkdir(exist_ok=True)
        for n in names:
            os.replace(staging.path / n, lock.output / n)
        fsync_dir(lock.output)

    def commit(self, begun: Begun | None, data: bytes | None) -> None:  # noqa: ARG002 - held by the lock
        if data is not None:
            atomic_write(self._out() / self.rules.commit_name, lambda file: file.write(data), tag=self.rules.tag)

    def finish(self, begun: Begun | None, *, keep: frozenset[str]) -> None:
        """The replaced output's files that the commit does not list (a killed writer's were removed at ``begin``,
        from the journal), then the lock released."""
        if begun is None:
            return
        try:
            remove_recorded(self._out(), begun.replaced_files, self.rules.claims, keep=set(keep))
        except OSError as exc:
            warnings.warn(f"{self.path}: could not remove the files of the output it replaced ({exc}); the next save "
                          "removes them", stacklevel=2)  # fmt: skip
        finally:
            if begun.release is not None:
                begun.release(False)

    def _out(self) -> Path:
        """The output as its lock names it, where this process holds the lock; else as given."""
        return self.lock.output if self.lock is not None else self.path


@contextlib.contextmanager
def staged_output(
    out: str | os.PathLike[str],
    claims: Claims,
    *,
    purpose: str,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
    replace: bool = True,
    entry: JournalEntry | None = None,
    commit_name: str = "",
) -> Iterator[Stage]:
    """Write a directory output all or nothing, through the one save driver (:func:`fsdp_optim.disk.save.saving`,
    with a :class:`RenameWriter`): the block fills ``stage.dir``; on a clean exit its files are moved into ``out``
    (``stage.last`` last), then the commit: ``stage.commit`` (bytes) renamed into place as ``commit_name``; then the
    files of the output it replaces are removed. ``entry``: what to journal besides the staging name (a format's
    ``created`` reads it)."""
    writer = staged_writer(out, claims, inputs=inputs, replace=replace, entry=entry, commit_name=commit_name)
    begun = writer.begin(purpose=purpose, overwrite=overwrite)
    with saving(writer, begun, save_id=writer.rules.tag) as save:
        stage = Stage(writer._out(), save.staging.path)
        yield stage
        last = list(stage.last)
        names = sorted(os.listdir(stage.dir), key=lambda n: (n in last, last.index(n) if n in last else 0))
        save.publish(names)
        save.commit(stage.commit, keep=[*names, commit_name])


def staged_writer(
    out: str | os.PathLike[str], claims: Claims, *, inputs: Iterable[Any] = (), replace: bool = True,
    entry: JournalEntry | None = None, commit_name: str = "",
) -> RenameWriter:  # fmt: skip
    """The :class:`RenameWriter` of a directory output staged beside ``out`` (its staging directory's name, with a
    new tag, journaled with ``entry``; ``commit_name``: the format's commit object, if it has one)."""
    from fsdp_optim.disk.local_directory import LocalDirectory  # (the local directory is the module above this one)

    tag = uuid.uuid4().hex[:12]
    rules = SaveRules(claims, entry or JournalEntry(), commit_name, frozenset(), lambda _where, _size: frozenset())
    staging = f".{resolve_output(out).name}{STAGING_MARK}{tag}"
    return RenameWriter(LocalDirectory(out), rules, staging=staging, inputs=inputs, replace=replace)


def remove_recorded(directory: Path, names: Iterable[str], claims: Claims, *, keep: set[str]) -> list[str]:
    """Delete ``names`` but ``keep`` from ``directory``: only names the format can make, only files (never a
    directory), never followed. ``names`` come from a record of ours (a manifest, a journal)."""
    removed = []
    for n in sorted(set(names) - keep):
        target = directory / n
        if claims.deletable(n) and (target.is_symlink() or target.is_file()):
            target.unlink(missing_ok=True)
            removed.append(n)
    return removed


def recover(directory: Path, entries: Sequence[JournalEntry], claims: Claims) -> list[str]:
    """Remove what journal ``entries`` announced and the output in ``directory`` does not use: the files each
    write creates (``claims.created``) and their temporary files, the files moved in by a write that never
    committed, the files a commit replaced once the output no longer names them, and the staging directories.
    Files are kept while the output's own record cannot be read (nothing proves them unused)."""
    referenced = claims.referenced(directory) if directory.is_dir() else set()
    own: set[str] = set()
    tagged: set[tuple[str, str]] = set()
    replaced: set[str] = set()
    for entry in entries:
        own |= claims.created(entry) | set(entry.moved or ())
        replaced.update(entry.replaces or ())
        if entry.file is not None and entry.tag is not None:
            tagged.add((entry.file, entry.tag))
        tagged |= claims.tagged(entry)
    removed = []
    if directory.is_dir():
        removed += sweep_temporaries(directory, own, tagged)
        if referenced is not None:
            removed += remove_recorded(directory, own | replaced, claims, keep=referenced)
    for entry in entries:
        staging = entry.staging
        if staging is not None and "/" not in staging and staging.startswith("."):
            path = directory.parent / staging
            if path.is_dir() and not path.is_symlink():
                # a staging directory is this package's alone (its name was journaled): what the format can make goes
                removed += sweep_temporaries(path, own, set())
                removed += remove_recorded(path, os.listdir(path), claims, keep=set())
                with contextlib.suppress(OSError):  # not empty: something not ours is in there, leave it
                    path.rmdir()
    return removed


def sweep_temporaries(directory: Path, own: set[str], tagged: set[tuple[str, str]]) -> list[str]:
    """Delete the temporary files (``disk.atomic`` names) of ``own`` names and of ``(name, tag)`` pairs."""
    removed = []
    for entry in os.scandir(directory):
        plain, with_tag = TEMP_NAME.match(entry.name), TAGGED_TEMP_NAME.match(entry.name)
        ours = (plain is not None and plain["final"] in own) or (
            with_tag is not None and (with_tag["final"], with_tag["tag"]) in tagged
        )
        if ours and not entry.is_dir(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


class _FileClaims:
    """A single output file claims nothing in a directory; its temporary file is journaled by tag."""

    def survey(self, directory: Path) -> Survey:  # noqa: ARG002
        return Survey()

    def created(self, entry: JournalEntry) -> set[str]:  # noqa: ARG002
        return set()

    def tagged(self, entry: JournalEntry) -> set[tuple[str, str]]:  # noqa: ARG002
        return set()

    def referenced(self, directory: Path) -> set[str]:  # noqa: ARG002
        return set()

    def deletable(self, name: str) -> bool:  # noqa: ARG002
        return False


def write_file(
    obj: Any, path: str | os.PathLike[str], *, inputs: Iterable[Any] = (), overwrite: bool = True
) -> int:
    """``torch.save`` of a single output file, atomically, under its lock, refused if it is one of ``inputs``;
    the temporary file is journaled, so one left by a killed writer is removed by the next. Returns the file's
    size. An existing file at ``path`` is replaced when ``overwrite`` (the API's default), else refused with
    ``FileExistsError`` and left as it was (the command line's default: ``-o FILE`` replaces only with
    ``--overwrite``)."""
    return _write_one(path, inputs, "write a file", lambda out, tag: atomic_save(obj, out, tag=tag), overwrite)


def write_stream(
    write: Callable[[BinaryIO], Any],
    path: str | os.PathLike[str],
    *,
    inputs: Iterable[Any] = (),
    purpose: str,
    overwrite: bool = True,
) -> int:
    """:func:`write_file` for a format that writes its own bytes: ``write(file)`` fills the (seekable) temporary
    file. Returns the file's size."""
    return _write_one(path, inputs, purpose, lambda out, tag: atomic_write(out, write, tag=tag)[0], overwrite)


def _write_one(
    path: str | os.PathLike[str],
    inputs: Iterable[Any],
    purpose: str,
    save: Callable[[Path, str], int],
    overwrite: bool,
) -> int:
    """Check, lock, recover, journal, then ``save(final path, tag)`` (an atomic write with that tag)."""
    check_not_input(path, inputs, name="output")
    tag = uuid.uuid4().hex[:12]
    with lock_output(path, purpose=purpose) as lock:
        if lock.previous:
            recover(lock.output.parent, lock.previous, _FileClaims())
            lock.forget()
        if not overwrite and os.path.lexists(lock.output):  # under the lock: no writer of ours is replacing it
            raise FileExistsError(
                f"{path}: exists already ({describe_file(lock.output)}); pass overwrite=True (--overwrite) to "
                "replace it"
            )
        lock.journal(JournalEntry(file=lock.output.name, tag=tag))
        return save(lock.output, tag)
