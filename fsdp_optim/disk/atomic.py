"""Atomic file writes (temporary file, fsync, rename, fsync the directory) and the one gated read of a torch file.

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

from fsdp_optim.disk.untrusted import load_untrusted


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



def atomic_save(obj: Any, path: str | os.PathLike[str], *, tag: str | None = None) -> int:
    """``torch.save(obj)`` to ``path`` through :func:`atomic_write` (temporary file, fsync, rename). Returns the
    file's size. torch's zip writer reports a failed write (disk full, file too large) as a bare ``RuntimeError``
    about stream positions; the operating system's error and the file are raised instead."""
    writers: list[_RecordingWriter] = []

    def write(file: BinaryIO) -> None:
        writers.append(_RecordingWriter(file))
        torch.save(obj, cast("IO[bytes]", writers[-1]))

    try:
        return atomic_write(path, write, tag=tag)[0]
    except RuntimeError as exc:
        cause = writers[-1].error if writers else None
        if cause is None:
            raise
        raise OSError(cause.errno, f"{path}: cannot write the checkpoint file: {cause.strerror or cause}") from exc


T = TypeVar("T")


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], T], *, tag: str | None = None, durable: bool = True
) -> tuple[int, T]:
    """Write ``path`` atomically: ``write(file)`` fills a temporary file beside it, which is flushed, fsynced and
    renamed over ``path``, then the directory is fsynced; returns ``(the file's size, what write returned)``.

    The temporary file is ``.<name>[.<tag>].tmp.<pid>.<random>``, created exclusively (never through an existing
    file or symlink); a writer that journals ``tag`` before writing lets the next holder of its lock recognise
    the file if it is killed (``disk/local_directory.py``). A failure removes it and leaves ``path`` as it was.
    ``durable=False`` skips both fsyncs: for a file that is only staged here, to be uploaded and removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{f'.{tag}' if tag else ''}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            result = write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{path}: cannot write the checkpoint file: {exc.strerror or exc}") from exc
        raise
    if durable:
        fsync_dir(path.parent)
    return size, result


def durable_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], T]) -> tuple[int, T]:
    """Create ``path`` (exclusively: never through an existing file or symlink), fill it with ``write(file)``,
    flush and fsync it; returns ``(its size, what write returned)``. No rename and no directory fsync: for a
    file in a staging directory, which becomes visible only when the whole output is moved in and its
    directory fsynced (``disk/local_directory.py``). A failure removes the file."""
    path = Path(path)
    try:
        with open(path, "xb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
    except BaseException as exc:
        path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{path}: cannot write the checkpoint file: {exc.strerror or exc}") from exc
        raise
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



def load_file(
    path: str | os.PathLike[str], *, mmap: bool = False, follow_symlinks: bool = True, disjoint: bool = False,
    tied: str | None = None,
    shared: bool = False,
) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU through the gate of :mod:`fsdp_optim.disk.untrusted`.

    Raises ``FileNotFoundError`` for nothing there, and ``ValueError`` naming the file for content that
    cannot be read, for a file that is not a regular file (a FIFO, a directory; a symlink where
    ``follow_symlinks=False``),
    exceeds a bound or holds what optimizer state does not (quantized, sparse, meta, complex tensors,
    overlapping or zero-stride views, cycles, nesting). ``disjoint=True`` for a file that must hold an
    optimizer state dict: two of its tensors sharing memory are refused too (a dict handed over in memory
    is checked for less: ``check_tree(in_memory=True)``); ``tied``: a top-level key whose dict may name one tensor
    more than once (tied parameters of a model's ``state_dict()``); ``shared``: tensors sharing memory are left for
    the caller to check once it knows what the file is (see :func:`~fsdp_optim.disk.objects.check_tree`).
    """
    return load_untrusted(path, mmap=mmap, follow_symlinks=follow_symlinks, disjoint=disjoint, tied=tied,
                          shared=shared)



# atomic_save's temporary names: ".<final>.tmp.<pid>.<8 hex>", or with a tag ".<final>.<12 hex>.tmp.<pid>.<8 hex>".
TEMP_NAME = re.compile(r"^\.(?P<final>.+)\.tmp\.\d+\.[0-9a-f]{8}$")



TAGGED_TEMP_NAME = re.compile(r"^\.(?P<final>.+)\.(?P<tag>[0-9a-f]{12})\.tmp\.\d+\.[0-9a-f]{8}$")
