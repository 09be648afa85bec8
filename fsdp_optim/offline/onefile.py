"""``consolidate -o FILE.safetensors`` written: :func:`write_one_file`, the one path to the file of
:func:`~fsdp_optim.offline.onefile_layout.lay_out`, for one process and for a team
(:mod:`fsdp_optim.offline.parallel.onefile`) alike, into one of two sinks (:class:`Sink`): a local file
(:class:`FileSink`: preallocated; each tensor made, written with os.pwrite at its offset, read back and compared,
freed; the header with every checksum written over its room at offset 0; fsync; rename), or the parts of one
multipart upload (:class:`~fsdp_optim.offline.onefile_parts.UploadSink`).

A failure at any step leaves no file: the temporary file is the one way out's (``disk.local_directory.write_stream``:
locked, journaled, removed on failure, renamed on success).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

import torch

from fsdp_optim.core.parts import PART_BYTES
from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.disk.local_directory import write_stream
from fsdp_optim.disk.location import shared_directory
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.named_safetensors.writer import tensor_checksums
from fsdp_optim.offline.onefile_layout import FileLayout, described, final_header, lay_out, stepped
from fsdp_optim.offline.onefile_parts import to_upload

if TYPE_CHECKING:
    from fsdp_optim.job.team import Team

__all__ = ["FileSink", "Sink", "consolidate_to_safetensors", "preallocate", "write_header", "write_one_file",
           "write_tensors"]

_IO_BYTES = 64 << 20  # one pwrite / pread at most (a tensor is written and read back in such pieces)
S = TypeVar("S")  # what one process's share of the file is to its sink


def preallocate(fd: int, size: int) -> None:
    """Make the file ``size`` bytes long, its blocks reserved where the file system can (else a sparse file)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:  # EOPNOTSUPP (some network file systems) or EINVAL: a hole-filled file of the size
        os.ftruncate(fd, size)


def write_tensors(
    path: str | os.PathLike[str], layout: FileLayout, which: Iterable[int], *, after: Callable[[int], None]
) -> dict[str, Any]:
    """Write tensors ``which`` of ``layout`` into the preallocated file ``path`` at their offsets, each read back
    and compared, then fsync; returns their checksums by name. ``after(nbytes)`` runs after each tensor."""
    sums: dict[str, Any] = {}
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        for i in which:
            t = layout.tensors[i]
            tensor = t.make()
            if tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
                raise ValueError(f"tensor '{t.name}': made as {tensor.dtype} {list(tensor.shape)}, planned as "
                                 f"{t.dtype} {list(t.shape)}")  # fmt: skip
            sums[t.name] = tensor_checksums(tensor, t.nbytes)
            _put(fd, tensor, layout.offsets[i], f"{path}: tensor '{t.name}'")
            del tensor
            after(t.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return sums


def _put(fd: int, tensor: torch.Tensor, offset: int, where: str) -> None:
    """The tensor's bytes written at ``offset``, then read back and compared piece by piece."""
    data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data).cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _IO_BYTES], offset + done)
    for at in range(0, len(data), _IO_BYTES):
        piece = data[at : at + _IO_BYTES]
        if os.pread(fd, len(piece), offset + at) != piece.tobytes():  # bytes to bytes: a memcmp, not item by item
            raise OSError(f"{where}: the bytes read back at offset {offset + at} differ from those written")


def write_header(fd: int, layout: FileLayout, shares: Sequence[Mapping[str, Any]]) -> None:
    """The final header (every share's checksums), written over the placeholders' room at offset 0."""
    header = final_header(layout, shares)
    done = 0
    while done < len(header):
        done += os.pwrite(fd, header[done:], done)


def consolidate_to_safetensors(
    opened: Any, output: str | os.PathLike[str], *, rank: int | None = None, no_model: bool = False,
    inputs: Sequence[Any] = (), overwrite: bool = True, progress: Callable[[], None] | None = None,
    part_bytes: int = PART_BYTES,
) -> str:  # fmt: skip
    """``opened`` consolidated into the one safetensors file ``output`` by this process (the module docstring): a
    local file, or an object of a store (the parts of one multipart upload of ``part_bytes`` parts; where the store
    has none, the file written locally and uploaded whole). Returns what was written (the verb's ``wrote <output>:
    ...``). An existing ``output`` is replaced only when ``overwrite``."""
    layout = lay_out(opened, rank=rank, no_model=no_model)
    size = write_one_file(None, layout, output, inputs=inputs, overwrite=overwrite, trim=opened.trim,
                          progress=progress, part_bytes=part_bytes)  # fmt: skip
    return described(layout, size)


class Sink(Protocol[S]):
    """Where the one file's bytes go: :meth:`write` puts tensors ``which`` of the layout (a process's run) and
    returns that share (its checksums, and what else the commit needs); :meth:`sent` is what of a share goes to
    process 0; :meth:`commit` (process 0) makes the file whole of every share."""

    def write(self, which: Sequence[int], rank: int, after: Callable[[int], None]) -> S: ...

    def sent(self, share: S) -> S: ...

    def commit(self, mine: S, shares: Sequence[S]) -> None: ...


class FileSink:
    """A local file at ``path``, preallocated: each tensor written at its offset and read back; the header (with
    every share's checksums) written by process 0, which holds the file open as ``fd``."""

    def __init__(self, layout: FileLayout, path: str, fd: int | None) -> None:  # noqa: D107
        self.layout, self.path, self.fd = layout, path, fd

    def write(self, which: Sequence[int], rank: int, after: Callable[[int], None]) -> dict[str, Any]:  # noqa: ARG002
        if not os.path.isfile(self.path):
            raise ValueError(f"{self.path}: process 0's temporary file is not visible here: the output must be on a "
                             "file system every process shares")  # fmt: skip
        return write_tensors(self.path, self.layout, which, after=after)

    def sent(self, share: dict[str, Any]) -> dict[str, Any]:
        return share

    def commit(self, mine: dict[str, Any], shares: Sequence[dict[str, Any]]) -> None:  # noqa: ARG002
        if self.fd is None:
            raise RuntimeError(f"{self.path}: the header is written by process 0, which holds the file open")
        write_header(self.fd, self.layout, shares)


def write_one_file(
    team: Team | None, layout: FileLayout, output: str | os.PathLike[str], *, inputs: Sequence[Any], overwrite: bool,
    trim: Callable[[], None], progress: Callable[[], None] | None = None, bar: bool = False,
    part_bytes: int = PART_BYTES,
) -> int:  # fmt: skip
    """The one path to a consolidated file: ``layout`` written into ``output`` by this process alone (``team``
    ``None``) or by every process of ``team``, each its run of tensors (split by bytes, in file order), into one of
    two sinks: a local file (:class:`FileSink`) or the parts of one multipart upload
    (:mod:`fsdp_optim.offline.onefile_parts`). Returns the file's size (0 on a process but 0 of a team)."""
    sizes = [t.nbytes for t in layout.tensors]
    runs = [range(len(sizes))] if team is None else split_by_bytes(sizes, team.size).runs
    fill = partial(_fill, team, runs, trim=trim, progress=progress, bar=bar, total=layout.size)
    try:
        if shared_directory(where(str(output))) is not None:
            return _to_file(team, layout, output, fill, inputs=inputs, overwrite=overwrite)
        size = to_upload(team, layout, runs, str(output), fill, inputs=inputs, overwrite=overwrite,
                         part_bytes=part_bytes)  # fmt: skip
    except _Agreed as agreed:
        raise agreed.error from None
    if size is None:  # a store without multipart uploads: the file written locally, then uploaded whole
        from fsdp_optim.offline.publish import output_for

        with output_for(output, overwrite=overwrite, inputs=inputs, keep_checkpoint=True) as local:
            size = _to_file(None, layout, local, fill, inputs=(), overwrite=True)
    return size


class _Agreed(BaseException):
    """A team's failure every process has agreed on already (the share step's), told apart from one still to agree
    on (process 0's open or commit): agreeing on it again would wait on a lost peer. :func:`write_one_file` raises
    its ``error``."""

    def __init__(self, error: Exception) -> None:  # noqa: D107
        super().__init__(str(error))
        self.error = error


def _fill(
    team: Team | None, runs: Sequence[Sequence[int]], sink: Sink[S], *, trim: Callable[[], None],
    progress: Callable[[], None] | None, bar: bool, total: int,
) -> tuple[S, list[S]]:  # fmt: skip
    """This process's run written into ``sink`` (a team's watch counting its bytes; every process agrees that every
    share is written): ``(its share, every share on process 0)``, which process 0 then commits."""
    rank = 0 if team is None else team.rank
    watch = None if team is None else team.progress(total, bar=bar, trim=trim)

    def alone(nbytes: int) -> None:  # noqa: ARG001 - a writer's after(nbytes); a team's watch counts them
        trim()
        if progress is not None:
            progress()

    try:
        with stepped(team, "consolidate failed on another process; nothing was committed", watch=watch):
            mine = sink.write(runs[rank], rank, alone if watch is None else watch.advance)
    except Exception as exc:
        if team is None:
            raise
        raise _Agreed(exc) from None  # every process raises it: no later step agrees on it again
    return mine, ([mine] if team is None else team.to_first(sink.sent(mine)) or [])


def _to_file(
    team: Team | None, layout: FileLayout, output: str | os.PathLike[str], fill: Callable[[FileSink], Any], *,
    inputs: Sequence[Any], overwrite: bool,
) -> int:  # fmt: skip
    """The local file sink: process 0 opens the output (:func:`write_stream`: lock, journal, a temporary file
    beside it), preallocates it and sends its path (``None``: it failed); every process fills it; process 0 writes
    the header, fsyncs and renames; every process agrees on that commit."""
    what = f"consolidate: process 0 could not write {output}; nothing was committed"
    sent = [False]

    def write(f: BinaryIO) -> None:
        preallocate(f.fileno(), layout.size)
        if team is not None:
            sent[0] = True
            team.from_first(f.name)
        sink = FileSink(layout, f.name, f.fileno())
        sink.commit(*fill(sink))

    if team is not None and team.rank != 0:
        path = team.from_first(None)
        if path is not None:  # else process 0's error comes with the agreement below
            fill(FileSink(layout, path, None))
        team.agree(None, what)  # on process 0's commit
        return 0
    try:
        size = write_stream(write, output, inputs=inputs, purpose="fsdp_optim.consolidate", overwrite=overwrite)
    except _Agreed:
        raise  # the share step's failure: every process agreed on it there
    except BaseException as exc:  # the open or the commit failed: the others are in the agreement below
        if team is not None and not sent[0]:  # the others wait for the temporary file's path: none
            team.from_first(None)
        if team is not None:
            team.agree(exc, what)
        raise
    if team is not None:
        team.agree(None, what)
    return size
