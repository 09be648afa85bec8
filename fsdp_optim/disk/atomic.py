"""File writes: atomic (temporary file, fsync, rename, fsync the directory), and hashed as they are written
(:class:`HashingWriter`).

Writes go to a hidden temporary file in the target directory, are flushed and ``fsync``-ed, then renamed over the final
name, and the directory is ``fsync``-ed: a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, Any, BinaryIO, TypeVar, cast

import torch


def new_save_id() -> str:
    return uuid.uuid4().hex



def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def save_into(obj: Any, file: BinaryIO) -> None:
    """``torch.save(obj)`` into ``file``. torch's zip writer reports a failed write (disk full, file too large) as a
    bare ``RuntimeError`` about stream positions; the operating system's error is raised instead."""
    recording = _RecordingWriter(file)
    try:
        torch.save(obj, cast("IO[bytes]", recording))
    except RuntimeError:
        if recording.error is None:
            raise
        raise recording.error from None


T = TypeVar("T")


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], T], *, tag: str | None = None, durable: bool = True,
    in_place: bool = False,
) -> tuple[int, T]:  # fmt: skip
    """Write ``path`` atomically: ``write(file)`` fills a temporary file beside it, which is flushed, fsynced and
    renamed over ``path``, then the directory is fsynced; returns ``(the file's size, what write returned)``.

    The temporary file is ``.<name>[.<tag>].tmp.<pid>.<random>``, created exclusively (never through an existing
    file or symlink); a writer that journals ``tag`` before writing lets the next holder of its lock recognise
    the file if it is killed (``disk/local_directory.py``). A failure removes it and leaves ``path`` as it was.
    ``durable=False`` skips both fsyncs: for a file that is only staged here, to be uploaded and removed.
    ``in_place``: ``path`` itself is created (exclusively) and fsynced, with no rename and no directory fsync: a file
    in a staging directory, which becomes visible when the whole output is moved in (``disk/local_directory.py``)."""
    path = Path(path)
    tagged = f".{tag}" if tag else ""
    tmp = path if in_place else path.with_name(f".{path.name}{tagged}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            result = write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        if not in_place:
            os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{path}: cannot write the checkpoint file: {exc.strerror or exc}") from exc
        raise
    if durable and not in_place:
        fsync_dir(path.parent)
    return size, result


class _RecordingWriter:
    """A file object for ``torch.save`` that remembers the first ``OSError`` its writes raised."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._file.flush()



# atomic_write's temporary names: ".<final>.tmp.<pid>.<8 hex>", or with a tag ".<final>.<12 hex>.tmp.<pid>.<8 hex>".
TEMP_NAME = re.compile(r"^\.(?P<final>.+)\.tmp\.\d+\.[0-9a-f]{8}$")



TAGGED_TEMP_NAME = re.compile(r"^\.(?P<final>.+)\.(?P<tag>[0-9a-f]{12})\.tmp\.\d+\.[0-9a-f]{8}$")


OVERLAP_BYTES = 8 << 20  # pieces smaller than this are written and hashed in turn (a host rank file's whole pieces)


class HashingWriter:
    """Writes pieces to ``file`` (at its position, in order) on a thread of its own (living as long as the ``with``
    block) while the caller's thread hashes them: a save pays the slower of the two, not both.

    A file's ``write`` and xxhash's ``update`` both release the GIL on a large buffer. A piece is done (its memory may
    be reused, e.g. a staging ring's slot) once both are: :meth:`put` returns only then. Pieces smaller than
    :data:`OVERLAP_BYTES` are written and hashed in turn on the caller's thread: a hand-off saves at most the piece's
    hash (xxh3: about 0.1 ms a MiB) and costs two to three context switches and, for 1-2.5 MiB pieces, about 20% more
    CPU time for the same bytes."""

    def __init__(self, file: BinaryIO, *, overlap_bytes: int = OVERLAP_BYTES) -> None:
        self.file = file
        self.overlap_bytes = overlap_bytes
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> HashingWriter:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_optim-write")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None

    def put(self, raw: memoryview, hash_update: Callable[[memoryview], object]) -> None:
        """Write ``raw`` to the file and feed it to ``hash_update``, both done when this returns (the write's error,
        if any, is raised here; a hashing error is raised once the write has finished with ``raw``)."""
        if self._pool is None or len(raw) < self.overlap_bytes:
            _write_all(self.file, raw)
            hash_update(raw)
            return
        pending = self._pool.submit(_write_all, self.file, raw)
        try:
            hash_update(raw)
        finally:
            pending.result()  # raw's memory is the caller's again only once the write is done with it


def _write_all(file: BinaryIO, raw: memoryview) -> None:
    """``file.write(raw)``, all of it (a raw, unbuffered file may take part of a large write)."""
    done = 0
    while done < len(raw):
        wrote = file.write(raw[done:])
        if wrote is None or wrote <= 0:
            raise OSError(f"{getattr(file, 'name', 'the file')}: a write took no bytes ({done} of {len(raw)} written)")
        done += wrote
