"""A checkpoint in a local directory: the :class:`~fsdp_optim.disk.location.Location` with rename and a lock.

Reads are ``stat``/``pread`` (nothing to retry); a save is the one way out of :mod:`fsdp_optim.disk.staged`: the
directory locked and the save journaled (:func:`~fsdp_optim.disk.staged.open_output`), each rank's files written in
place and fsynced, the manifest renamed into place last, the replaced checkpoint's files removed, the lock
released (a failed save's files removed first, from its journal). ``os.fspath`` of it is its path, so the readers
that map files take it as they take a ``Path``.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from fsdp_optim.disk.atomic import atomic_write, fsync_dir
from fsdp_optim.disk.byte_io import StoredObject
from fsdp_optim.disk.errors import ConcurrentCommitError
from fsdp_optim.disk.location import Begun, Location, SaveRules, Staging, T
from fsdp_optim.disk.locks import OutputLockedError, lock_output
from fsdp_optim.disk.staged import close_output, open_output
from fsdp_optim.disk.store_answers import Tiling
from fsdp_optim.disk.store_policy import RetryPolicy

__all__ = ["LocalDirectory"]

_NO_RETRIES = RetryPolicy(float("inf"), attempts=1)  # a local read either works or says why at once


class LocalDirectory(Location):
    """The local directory ``path`` (need not exist until a save creates it)."""

    policy = _NO_RETRIES

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

    @property
    def name(self) -> str:
        return self.path.name

    def public(self) -> Path:
        return self.path

    def local_path(self) -> Path:
        return self.path

    def identity(self) -> str:
        return str(self.path.absolute())

    def parent(self) -> LocalDirectory:
        return LocalDirectory(self.path.parent)

    # -- reading -------------------------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.path.is_dir()

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

    def present(self) -> bool:
        return self.path.is_dir()

    def non_objects(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.path) if not e.is_file(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

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

    @contextmanager
    def fetched_whole(self, name: str) -> Iterator[Path]:
        """The object's own file: nothing copied, nothing removed after."""
        if self.size(name) is None:
            raise FileNotFoundError(f"{self / name}: no such object")
        yield self.path / name

    def write(self, name: str, data: bytes | Path) -> None:
        """Object ``name`` written whole, atomically (a temporary file renamed into place, fsynced)."""
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)  # (a store's prefix exists once an object does)
        if isinstance(data, Path):
            with open(data, "rb") as source:
                atomic_write(target, lambda file: shutil.copyfileobj(source, file))
        else:
            atomic_write(target, lambda file: file.write(data))

    def etag(self, name: str) -> str | None:
        """The file's size and modification time (as its listing gives them), ``None`` when there is none."""
        found = self.size(name)
        return None if found is None else f"{found}-{os.stat(self.path / name).st_mtime}"

    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None:
        """Checked, then renamed into place: exact while a save holds the directory's lock (:meth:`begin_save`),
        which a save's own commit (:meth:`commit_manifest`) relies on instead."""
        if (found := self.etag(name)) != replaces:
            raise ConcurrentCommitError(f"{self / name}: changed by another writer ({found}, not {replaces})")
        self.write(name, data)

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            (self.path / name).unlink(missing_ok=True)

    @contextmanager
    def guarded(self, *, purpose: str) -> Iterator[bool]:
        """Under the directory's lock (``False``, nothing taken, while a writer holds it); the lock's journal is
        dropped once the directory is gone."""
        try:
            lock = lock_output(self.path, purpose=purpose)
        except OutputLockedError:
            yield False
            return
        with lock:
            yield True
            if not os.path.lexists(self.path):
                lock.forget()

    @contextmanager
    def written_here(
        self, publishing: Callable[[Path], AbstractContextManager[T]]  # noqa: ARG002 - nothing to publish
    ) -> Iterator[tuple[str | os.PathLike[str], T | None]]:
        """The directory (or file) itself, spelled as given (an output's messages name it so): written in place."""
        yield self.given, None

    def remove_marker(self) -> None:
        """The emptied directory itself (``OSError`` if anything is left in it)."""
        os.rmdir(self.path)
        fsync_dir(self.path.parent)

    # -- saving: the hooks where a local directory does better than a store's defaults ---------------------------

    def begin_save(self, rules: SaveRules, *, purpose: str, overwrite: bool) -> Begun:
        """The directory locked, what a killed writer left removed, foreign content refused (unless ``overwrite``)
        and the save journaled with what its commit replaces (:func:`~fsdp_optim.disk.staged.open_output`); the lock
        and journal are closed by ``finish_save`` (a failed save's files removed by the journal)."""
        lock = open_output(self.path, rules.claims, rules.entry, purpose=purpose, overwrite=overwrite)
        replaced = frozenset(lock.entries[-1].replaces or ())
        return Begun(rules, None, replaced, release=lambda failed: close_output(lock, rules.claims, failed=failed))

    def stage(self, save_id: str, rank: int) -> Staging:  # noqa: ARG002 - every rank writes in place
        return Staging(self.path, durable=True, scratch=False)

    def commit_manifest(self, rules: SaveRules, begun: Begun | None, data: bytes) -> None:  # noqa: ARG002
        """Renamed into place (under the save's lock; ``begun`` ``None``: a directory of the job's own): its
        temporary file carries the save's tag, so the journal of a save killed here names it."""
        atomic_write(self.path / rules.commit_name, lambda file: file.write(data), tag=rules.tag)

    # -- what it can do ------------------------------------------------------------------------------------

    def shared_by_processes(self) -> bool:
        return True

    def same_place(self, other: Location) -> bool:
        """The same directory once symlinks are resolved (``other`` of another kind never is)."""
        return isinstance(other, LocalDirectory) and self.path.resolve() == other.path.resolve()

    @contextmanager
    def as_local_file(self) -> Iterator[str | os.PathLike[str]]:
        """Its own path, spelled as given, whatever is there (the reader that opens it says what is wrong)."""
        yield self.given
