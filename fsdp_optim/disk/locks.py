"""One writer at a time per output: an exclusive lock beside each output, the journal kept in it, and the recovery
from that journal (:func:`recover`).

Every local writer holds :func:`lock_output` for its output while it writes::

    ckpt/                                  # the output directory (may not exist yet)
    .ckpt.fsdp-optim.lock                  # beside it: {"holder": {...}} then one {"journal": {...}} per line

**Which lock, and why.** ``fcntl.flock`` on a lock file beside the output. The kernel drops an flock
the moment its holder dies (``SIGKILL`` included), so a crashed writer never blocks the next one, and
no live writer's lock is ever broken on a guess (pid reuse, clock skew, a slow client): a lock is stale
exactly when its holder is gone. It lives *beside* the output because the output may not exist yet, and
a refused writer must leave it exactly as it was. The path is resolved first (symlinks, ``..``), so two
spellings of one directory share one lock.

Where ``flock`` is unsupported (``ENOLCK``/``EOPNOTSUPP``/``ENOSYS``: some network and FUSE file
systems), or where it does not reach other hosts (NFS mounted with ``local_lock=flock``: set
``FSDP_OPTIM_LOCK=exclusive``), the lock is the lock file itself, created with ``O_CREAT|O_EXCL``. Such
a lock is *stale* when its recorded holder is a process of this host that no longer runs (pid and
start time compared, so a reused pid does not count), or when it is older than
:data:`STALE_AFTER_S` (its holder refreshes it with every journal entry); a stale lock is broken by an
atomic rename, so two writers breaking it at once cannot both win.

**The journal.** Before a writer creates a file it records what it is about to create (and what its
commit will make obsolete) in the lock file. A clean release deletes the lock file; a killed writer
leaves it, and the next holder of the lock gets those entries (the lock's ``previous``), so it can
remove exactly what the killed writer left, and nothing else (:func:`recover`; the writers:
``disk/local_directory.py``).

"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_optim.disk.atomic import TAGGED_TEMP_NAME, TEMP_NAME
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.save import Claims

__all__ = [
    "LOCK_SUFFIX",
    "STALE_AFTER_S",
    "OutputLock",
    "OutputLockedError",
    "check_not_input",
    "lock_output",
    "lock_path",
    "recover",
    "remove_recorded",
    "resolve_output",
    "sweep_temporaries",
]

LOCK_SUFFIX = ".fsdp-optim.lock"
STALE_AFTER_S = 6 * 3600  # exclusive-file mode only: a lock untouched this long on another host is stale
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class OutputLockedError(OSError):
    """Another writer holds the output's lock; the message names it (pid, host, since, what it does)."""


def resolve_output(output: str | os.PathLike[str]) -> Path:
    return Path(os.path.realpath(output))


def lock_path(output: str | os.PathLike[str]) -> Path:
    """Where the lock of ``output`` lives: ``<parent>/.<name>.fsdp-optim.lock`` of the resolved path."""
    resolved = resolve_output(output)
    return resolved.parent / f".{resolved.name}{LOCK_SUFFIX}"


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


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), if known."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _holder(purpose: str) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start": _start_ticks(os.getpid()),
        "since": time.time(),
        "purpose": purpose,
    }


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another writer (no holder recorded)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
    return f"pid {holder.get('pid')} on {holder.get('host')} since {since} ({holder.get('purpose')})"


def _parse(text: bytes) -> tuple[dict[str, Any] | None, list[JournalEntry]]:
    """The holder and journal entries of a lock file; a torn last line (a killed write) is ignored."""
    holder: dict[str, Any] | None = None
    entries: list[JournalEntry] = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("holder"), dict):
            holder = record["holder"]
        elif isinstance(record, dict) and isinstance(record.get("journal"), dict):
            entries.append(JournalEntry.from_json(record["journal"]))
    return holder, entries


def _read_fd(fd: int, limit: int = 1 << 24) -> bytes:
    return os.pread(fd, min(os.fstat(fd).st_size, limit), 0)


class OutputLock:
    """A held lock on one output. ``previous``: the journal a killed holder left (empty after a clean
    release). :meth:`journal` records an entry; :meth:`release` (or leaving the ``with`` block) frees it."""

    def __init__(self, output: Path, path: Path, fd: int, previous: list[JournalEntry], purpose: str) -> None:
        self.output = output
        self.path = path
        self.previous = previous
        self.entries: list[JournalEntry] = []  # this holder's own journal
        self._fd: int | None = fd
        self._holder = _holder(purpose)
        # Appended, not rewritten: a killed holder's journal stays until forget(), after it was acted on.
        os.pwrite(fd, b"\n" + json.dumps({"holder": self._holder}).encode() + b"\n", os.fstat(fd).st_size)
        os.fsync(fd)

    def _held(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.output}: this output lock was released; expected a held lock")
        return self._fd

    def journal(self, entry: JournalEntry) -> None:
        """Append ``entry`` durably, before doing what it announces."""
        fd = self._held()
        os.pwrite(fd, json.dumps({"journal": entry.to_json()}).encode() + b"\n", os.fstat(fd).st_size)
        os.fsync(fd)
        os.utime(fd)  # exclusive-file mode: a live holder's lock never looks old
        self.entries.append(entry)

    def forget(self) -> None:
        """Drop every journal entry (what they announced is done or cleaned up); keep holding the lock."""
        fd = self._held()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"holder": self._holder}).encode() + b"\n", 0)
        os.fsync(fd)
        self.previous, self.entries = [], []

    def release(self) -> None:
        """Delete the lock file, then let go of it (a clean exit leaves nothing behind)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(fd)

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_output(output: str | os.PathLike[str], *, purpose: str) -> OutputLock:
    """Take the exclusive lock of ``output`` (a directory or file, existing or not) or raise
    :class:`OutputLockedError` naming the holder (and its ``purpose``) at once."""
    resolved = resolve_output(output)
    path = lock_path(resolved)
    try:
        return _take_lock(resolved, path, purpose)
    except OutputLockedError:
        raise
    except OSError as exc:  # the output's place cannot be written: say so of the output, not of its lock file
        why = exc.strerror or str(exc)
        at = f" at {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
        raise type(exc)(
            f"{resolved}: cannot write this output: {why}{at} (the directory {path.parent} must exist or be "
            f"creatable, and be writable: its lock file {path.name} is made there first)"
        ) from exc


def _take_lock(resolved: Path, path: Path, purpose: str) -> OutputLock:
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.environ.get("FSDP_OPTIM_LOCK", "flock") != "exclusive":
        for _ in range(100):  # another writer may delete the file between our open and our flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder, _ = _parse(_read_fd(fd))
                os.close(fd)
                raise OutputLockedError(
                    f"{resolved}: another writer is writing there: {_describe(holder)}; wait for it to finish "
                    f"(its lock, {path}, is released when it exits or dies)"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _UNSUPPORTED:
                    raise
                break  # no flock here: fall back to an exclusive lock file
            try:
                same = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                same = None
            mine = os.fstat(fd)
            if same is None or (same.st_dev, same.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)  # we locked a lock file its holder had just deleted: try again
                continue
            _, previous = _parse(_read_fd(fd))
            return OutputLock(resolved, path, fd, previous, purpose)
        else:
            raise OutputLockedError(f"{resolved}: could not take its lock {path} (it keeps being replaced)")
    return _lock_exclusive(resolved, path, purpose)


def _alive(holder: dict[str, Any]) -> bool:
    """Whether a holder recorded on this host still runs (the same process: pid and start time)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = holder.get("start")
    return start is None or _start_ticks(pid) in (None, start)


def _lock_exclusive(resolved: Path, path: Path, purpose: str) -> OutputLock:
    """The fallback: the lock file exists exactly while someone holds the lock (or died holding it)."""
    previous: list[JournalEntry] = []
    broken_files: list[Path] = []
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            pass
        else:
            # The dead holder's journal moves into our lock file before its old file goes.
            os.write(fd, b"".join(json.dumps({"journal": e.to_json()}).encode() + b"\n" for e in previous))
            os.fsync(fd)
            for broken in broken_files:
                broken.unlink(missing_ok=True)
            return OutputLock(resolved, path, fd, previous, purpose)
        try:
            text, age = path.read_bytes(), time.time() - path.stat().st_mtime
        except FileNotFoundError:
            continue  # released meanwhile
        holder, _ = _parse(text)
        here = holder is not None and holder.get("host") == socket.gethostname()
        stale = (here and holder is not None and not _alive(holder)) or age > STALE_AFTER_S
        if not stale:
            raise OutputLockedError(
                f"{resolved}: another writer is writing there: {_describe(holder)}; wait for it to finish, or, if "
                f"it is gone and on another host, remove {path} (it counts as stale after {STALE_AFTER_S} s)"
            )
        # Break it: rename it away (one breaker wins), then check we took the lock we judged stale.
        broken = path.with_name(f"{path.name}.stale.{uuid.uuid4().hex[:12]}")
        try:
            os.rename(path, broken)
        except FileNotFoundError:
            continue
        if broken.read_bytes() != text:  # someone broke it first and a live writer made a new one: put it back
            with contextlib.suppress(FileExistsError):
                os.link(broken, path)
            broken.unlink(missing_ok=True)
            continue
        previous += _parse(text)[1]
        broken_files.append(broken)
    raise OutputLockedError(f"{resolved}: could not take its lock {path}")



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
