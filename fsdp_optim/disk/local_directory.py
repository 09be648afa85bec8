"""A checkpoint in a local directory: the :class:`~fsdp_optim.disk.location.Location` with rename and a lock, and the
one way out of a local directory, its writer of the one save protocol (:class:`RenameWriter`; :func:`staged_output`:
a directory output of any format written all or nothing through it; one file: ``disk/one_file.py``).

Reads are ``stat``/``pread`` (nothing to retry). What every local writer gets, whatever the format::

    out/                                   # the output (may not exist yet)
    .out.fsdp-optim.lock                   # beside it: the lock and its journal (disk/locks.py)
    .out.fsdp-optim-staging.<12 hex>/      # a staged output's files are written here, then moved into out/

1. ``out`` must not be (or hold) one of ``inputs`` (:func:`~fsdp_optim.disk.locks.check_not_input`).
2. ``out``'s lock is taken (a second writer gets ``OutputLockedError``).
3. What a killed writer of ``out`` left is removed, exactly as its journal announced it
   (:func:`~fsdp_optim.disk.locks.recover`).
4. Content of ``out`` that the format does not claim is *foreign* (:func:`fsdp_optim.disk.save.surveyed`): refused
   with ``ForeignOutputError`` unless ``overwrite``, and never deleted (a foreign file where the format commits, such
   as another tool's ``manifest.json``, is refused even with ``overwrite``: the commit would replace it).
5. The write is journaled before any file exists (its staging directory, the names it will create, what its commit
   replaces); the files are written in place (a job's ranks) or staged and moved in, the format's commit object (our
   manifest) renamed into place last; then the replaced output's files are removed.
6. A refused or failed write leaves ``out`` as it was; a killed one is cleaned up by the next writer.

A format says what is its own with a :class:`~fsdp_optim.disk.save.Claims` (``formats/sharded/writer.py``: our
checkpoint; ``formats/fairseq``: a shard set; ``formats/dcp.py``: a DCP directory). This module knows no format.
``os.fspath`` of a :class:`LocalDirectory` is its path, so the readers that map files take it as they take a ``Path``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fsdp_optim.disk.atomic import atomic_write, fsync_dir
from fsdp_optim.disk.byte_io import StoredObject, Tiling
from fsdp_optim.disk.errors import ConcurrentCommitError
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.location import Location, T
from fsdp_optim.disk.locks import (
    OutputLock,
    OutputLockedError,
    check_not_input,
    lock_output,
    recover,
    remove_recorded,
    resolve_output,
)
from fsdp_optim.disk.save import Begun, Claims, SaveRules, Staging, Writer, saving, surveyed

__all__ = ["LocalDirectory", "RenameWriter", "Stage", "staged_output", "staged_writer"]


class LocalDirectory(Location):
    """The local directory ``path`` (need not exist until a save creates it)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:  # noqa: D107 - see the class
        self.path = Path(path)
        self.given = path  # as the caller spelled it

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LocalDirectory({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalDirectory) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def child(self, name: str) -> LocalDirectory:
        return LocalDirectory(self.path / name)

    def local_path(self) -> Path:
        return self.path

    def parent(self) -> LocalDirectory:
        return LocalDirectory(self.path.parent)

    # -- reading -------------------------------------------------------------------------------------------

    def listing(self) -> dict[str, StoredObject]:
        try:
            entries = list(os.scandir(self.path))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        found = {}
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                found[e.name] = StoredObject(e.name, st.st_size, st.st_mtime, None)
        return found

    def prefixes(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, name: str) -> int | None:
        try:
            st = os.stat(self.path / name, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None:
        stop = start + sum(t.nbytes for t in targets)
        place = Tiling(start, targets)
        fd = os.open(self.path / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            at = start
            while at < stop:
                data = os.pread(fd, min(stop - at, 16 << 20), at)
                if not data:
                    raise OSError(f"{self / name}: ends at byte {at}, expected at least {stop}")
                place.copy(at, data)
                at += len(data)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes | Path) -> None:
        """Object ``name`` written whole, atomically (a temporary file renamed into place, fsynced)."""
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)  # (a store's prefix exists once an object does)
        if isinstance(data, Path):
            with open(data, "rb") as source:
                atomic_write(target, lambda file: shutil.copyfileobj(source, file))
        else:
            atomic_write(target, lambda file: file.write(data))

    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None:
        """Checked (its size and time as its listing gives them), then renamed into place: exact while a save holds
        the directory's lock, which a save's own commit (:class:`RenameWriter`) relies on instead."""
        size = self.size(name)
        if (found := None if size is None else f"{size}-{os.stat(self.path / name).st_mtime}") != replaces:
            raise ConcurrentCommitError(f"{self / name}: changed by another writer ({found}, not {replaces})")
        self.write(name, data)

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            (self.path / name).unlink(missing_ok=True)

    @contextmanager
    def removal(self, *, purpose: str) -> Iterator[Callable[[], None] | None]:
        """Under the directory's lock (``None`` while a writer holds it), the emptied directory itself removed by the
        call (``OSError`` if anything is left in it); the lock's journal is dropped once the directory is gone."""
        try:
            lock = lock_output(self.path, purpose=purpose)
        except OutputLockedError:
            yield None
            return
        with lock:
            yield self._remove_directory
            if not os.path.lexists(self.path):
                lock.forget()

    def _remove_directory(self) -> None:
        os.rmdir(self.path)
        fsync_dir(self.path.parent)

    @contextmanager
    def written_here(
        self, publishing: Callable[[Path], AbstractContextManager[T]]  # noqa: ARG002 - nothing to publish
    ) -> Iterator[tuple[str | os.PathLike[str], T | None]]:
        """The directory (or file) itself, spelled as given (messages name it so)."""
        yield self.given, None

    def writer(self, rules: SaveRules) -> RenameWriter:
        return RenameWriter(self, rules)


@dataclass
class Stage:
    """An output being written: put files into ``dir``; they are moved into the output when the block ends, ``last``
    last, then ``commit`` (the commit object's bytes, if the format has one) is renamed into place."""

    dir: Path
    last: Sequence[str] = ()  # names moved in after every other file (a format's commit point)
    commit: bytes | None = None


class RenameWriter(Writer):
    """A local directory's save (steps 1-6 of the module docstring): written in place by every rank of a job, or
    (``staging``: its name) staged beside the output and moved in when published, the move journaled first; the
    commit object's temporary file carries the save's tag, so the journal of a save killed there names it.
    ``replace=False``: a checkpoint there is refused too."""

    location: Location

    def __init__(self, location: Location, rules: SaveRules, *, staging: str | None = None,
                 inputs: Iterable[Any] = (), replace: bool = True) -> None:  # fmt: skip  # noqa: D107 - see the class
        super().__init__(location, rules)
        path = location.local_path()
        assert path is not None, f"{location}: a rename needs a local directory"
        self.path, self.staging, self.inputs, self.replace = path, staging, inputs, replace
        self.lock: OutputLock | None = None  # held from begin (rank 0's) to finish or abort

    def begin(self, *, purpose: str, overwrite: bool) -> Begun:
        """Steps 1-4 and the journal of step 5; the lock is held until :meth:`finish` or :meth:`abort`."""
        claims, entry = self.rules.claims, dataclasses.replace(self.rules.entry, staging=self.staging)
        check_not_input(self.path, self.inputs)
        self.lock = lock = lock_output(self.path, purpose=purpose)
        try:
            if lock.previous:
                recover(lock.output, lock.previous, claims)
                lock.forget()
            replaced = surveyed(lock.output, claims, overwrite=overwrite, replace=self.replace)
            lock.journal(dataclasses.replace(entry, replaces=tuple(sorted(replaced))))
        except BaseException:
            lock.release()
            raise
        return Begun(None, replaced, release=partial(self._release, lock))

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
        """The replaced output's files that the commit does not list removed, then the lock released."""
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

    def abort(self, begun: Begun | None, staging: Staging, names: Sequence[str]) -> None:  # noqa: ARG002
        """The save's journal undoes it as the lock is released."""
        if begun is not None and begun.release is not None:
            begun.release(True)

    def _release(self, lock: OutputLock, failed: bool) -> None:
        """Release the lock; if the save failed, first remove what its journal says it created."""
        try:
            if failed:
                recover(lock.output, lock.entries, self.rules.claims)
        finally:
            lock.release()

    def _out(self) -> Path:
        """The output as its lock names it, where this process holds the lock; else as given."""
        return self.lock.output if self.lock is not None else self.path


@contextmanager
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
    """Write a directory output all or nothing through the one save driver: the block fills ``stage.dir`` (a
    :class:`Stage`); ``stage.commit`` is renamed into place as ``commit_name``. ``entry``: what to journal besides
    the staging name (a format's ``created`` reads it)."""
    writer = staged_writer(out, claims, inputs=inputs, replace=replace, entry=entry, commit_name=commit_name)
    begun = writer.begin(purpose=purpose, overwrite=overwrite)
    with saving(writer, begun, save_id=writer.rules.tag) as save:
        stage = Stage(save.staging.path)
        yield stage
        last = list(stage.last)
        names = sorted(os.listdir(stage.dir), key=lambda n: (n in last, last.index(n) if n in last else 0))
        save.publish(names)
        save.commit(stage.commit, keep=[*names, commit_name])


def staged_writer(
    out: str | os.PathLike[str], claims: Claims, *, inputs: Iterable[Any] = (), replace: bool = True,
    entry: JournalEntry | None = None, commit_name: str = "",
) -> RenameWriter:  # fmt: skip
    """The :class:`RenameWriter` of a directory output staged beside ``out``, in a directory of a new tag."""
    tag = uuid.uuid4().hex[:12]
    rules = SaveRules(claims, entry or JournalEntry(), commit_name, frozenset(), lambda _where, _size: frozenset())
    staging = f".{resolve_output(out).name}.fsdp-optim-staging.{tag}"
    return RenameWriter(LocalDirectory(out), rules, staging=staging, inputs=inputs, replace=replace)

