"""The steps of the one way out of a local directory: the lock, its journal and the recovery from it that a local
directory's writer of the one save protocol takes (:class:`~fsdp_optim.disk.local_directory.RenameWriter`, behind
``staged_output`` for a directory of files and every job save), and :func:`write_file` (one file).

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

A format says what is its own with a :class:`~fsdp_optim.disk.save.Claims` (``formats/sharded/writer.py``: our
checkpoint; ``formats/fairseq``: a shard set; ``formats/dcp.py``: a DCP directory). This module knows no format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from fsdp_optim.disk.atomic import TAGGED_TEMP_NAME, TEMP_NAME, atomic_save, atomic_write
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.locks import ForeignOutputError, OutputLock, lock_output, resolve_output
from fsdp_optim.disk.save import Claims, Survey, refuse_foreign
from fsdp_optim.disk.untrusted import describe_file

__all__ = [
    "check_not_input",
    "close_output",
    "open_output",
    "recover",
    "write_file",
    "write_stream",
]

STAGING_MARK = ".fsdp-optim-staging."


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
