"""Atomic file writes (temporary file, fsync, rename, fsync the directory).

Writes go to a hidden temporary file in the target directory, are flushed and ``fsync``-ed, then renamed over the final
name, and the directory is ``fsync``-ed: a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
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
