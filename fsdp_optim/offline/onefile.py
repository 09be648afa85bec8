"""``consolidate -o FILE.safetensors`` written: :func:`write_one_file`, the one path to the file of
:func:`~fsdp_optim.offline.onefile_layout.lay_out`, for one process and for a team
(:mod:`fsdp_optim.offline.parallel.onefile`) alike, into one of two sinks (:class:`Sink`): a local file
(:class:`FileSink`: laid out by ftruncate; each tensor made, hashed, written with os.pwrite at its offset, freed),
or the parts of one multipart upload (:class:`~fsdp_optim.offline.onefile_parts.UploadSink`). Either is a
save of one object through the one driver (:func:`fsdp_optim.disk.save.saving`), whose commit's data is the header
with every checksum: written over its room at offset 0, fsync, rename (:class:`~fsdp_optim.disk.one_file.FileWriter`:
locked, journaled), or put into the held part and the upload completed. A failure at any step leaves no file: the
temporary file removed, the upload aborted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fsdp_optim.core.split import PART_BYTES, split_by_bytes
from fsdp_optim.disk.location import shared_directory
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.one_file import FileWriter
from fsdp_optim.disk.save import Save, Writer, saving
from fsdp_optim.offline.onefile_layout import FileLayout, described, final_header, lay_out, made, stepped
from fsdp_optim.offline.onefile_parts import upload_sink

if TYPE_CHECKING:
    from fsdp_optim.job.team import Team

__all__ = ["FileSink", "Sink", "consolidate_to_safetensors", "write_one_file", "write_tensors"]

_IO_BYTES = 64 << 20  # one pwrite at most
S = TypeVar("S")  # what one process's share of the file is to its sink


def write_tensors(
    path: str | os.PathLike[str], layout: FileLayout, which: Iterable[int], *, after: Callable[[int], None]
) -> dict[str, Any]:
    """Write tensors ``which`` of ``layout`` into the laid-out file ``path`` at their offsets, then fsync; returns
    their checksums by name, computed from the bytes written (a reader checks them: nothing is read back here).
    ``after(nbytes)`` runs after each tensor."""
    sums: dict[str, Any] = {}
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        for i in which:
            data, done = made(layout.tensors[i], sums), 0  # (freed before the next)
            while done < len(data):
                done += os.pwrite(fd, data[done : done + _IO_BYTES], layout.offsets[i] + done)
            after(len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    return sums


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
    """Where the one file's bytes go, the writer of its save (:func:`~fsdp_optim.disk.save.saving`) with it:
    :meth:`open` (process 0: the save begun, what the others need sent), :meth:`write` puts process ``rank``'s run of
    tensors and returns that share (its checksums, and what else the commit needs); :meth:`sent` is
    what of a share goes to process 0; :meth:`header` (process 0) is the commit's data: the final header of every
    share."""

    target: str  # what process 0's open sent: the temporary file's path, the upload's id

    @property
    def writer(self) -> Writer: ...

    def open(self, save: Save) -> str: ...

    def write(self, rank: int, after: Callable[[int], None]) -> S: ...

    def sent(self, share: S) -> S: ...

    def header(self, mine: S, shares: Sequence[S]) -> bytes: ...


class FileSink:
    """A local file, staged beside ``output`` (:class:`~fsdp_optim.disk.one_file.FileWriter`) and laid out by process
    0 (ftruncate: no block reserved before its writer fills it), whose temporary file every process fills."""

    def __init__(  # noqa: D107
        self, layout: FileLayout, runs: Sequence[Sequence[int]], output: str | os.PathLike[str], inputs: Sequence[Any]
    ) -> None:
        self.layout, self.runs, self.writer, self.target = layout, runs, FileWriter(output, inputs=inputs), ""

    def open(self, save: Save) -> str:
        with open(save.staging.path, "r+b") as file:
            os.ftruncate(file.fileno(), self.layout.size)
        return str(save.staging.path)

    def write(self, rank: int, after: Callable[[int], None]) -> dict[str, Any]:
        if not os.path.isfile(self.target):
            raise ValueError(f"{self.target}: process 0's temporary file is not visible here: the output must be on a "
                             "file system every process shares")  # fmt: skip
        return write_tensors(self.target, self.layout, self.runs[rank], after=after)

    def sent(self, share: dict[str, Any]) -> dict[str, Any]:
        return share

    def header(self, mine: dict[str, Any], shares: Sequence[dict[str, Any]]) -> bytes:  # noqa: ARG002
        return final_header(self.layout, shares)


def write_one_file(
    team: Team | None, layout: FileLayout, output: str | os.PathLike[str], *, inputs: Sequence[Any], overwrite: bool,
    trim: Callable[[], None], progress: Callable[[], None] | None = None, bar: bool = False,
    part_bytes: int = PART_BYTES,
) -> int:  # fmt: skip
    """The one path to a consolidated file, a save through the one driver: ``layout`` written into ``output`` by
    this process alone (``team`` ``None``) or by every process of ``team``, each its run of tensors (split by bytes,
    in file order), into one of two sinks: a local file (:class:`FileSink`) or the parts of one multipart upload
    (:class:`~fsdp_optim.offline.onefile_parts.UploadSink`). Process 0 opens the output (every process gets what it
    sent), every process writes its run, process 0 commits (the header: renamed, or the upload completed); each
    step agreed. Returns the file's size (0 on a process but 0 of a team)."""
    sizes = [t.nbytes for t in layout.tensors]
    runs = [range(len(sizes))] if team is None else split_by_bytes(sizes, team.size).runs
    rank = 0 if team is None else team.rank
    in_place = shared_directory(where(str(output))) is not None
    sink: Sink[Any] | None = (FileSink(layout, runs, output, inputs) if in_place else
                              upload_sink(layout, runs, str(output), inputs=inputs, part_bytes=part_bytes))  # fmt: skip
    if sink is None:  # a store without multipart uploads: the file written locally, then uploaded whole
        from fsdp_optim.offline.publish import output_for

        if team is not None:  # (a team splits only an output it can write in parts: parallel/entry.splits)
            raise ValueError(f"output: {output}: its store takes no multipart uploads")

        with output_for(output, overwrite=overwrite, inputs=inputs, keep_checkpoint=True) as local:
            return write_one_file(None, layout, local, inputs=(), overwrite=True, trim=trim, progress=progress)
    agreed = partial(stepped, team)
    with saving(sink.writer, None, save_id="", rank=rank, agreed=agreed) as save:
        with agreed(f"consolidate: process 0 could not open {output}; nothing was written"):
            if rank == 0:
                save.begin(purpose="fsdp_optim.consolidate", overwrite=overwrite)
            opened = sink.open(save) if rank == 0 else ""
        sink.target = opened if team is None else str(team.from_first(opened))
        mine, shares = _fill(team, sink, trim=trim, progress=progress, bar=bar, total=layout.size)
        save.commit(sink.header(mine, shares) if rank == 0 else None)
    return layout.size if rank == 0 else 0


def _fill(
    team: Team | None, sink: Sink[S], *, trim: Callable[[], None], progress: Callable[[], None] | None, bar: bool,
    total: int,
) -> tuple[S, list[S]]:  # fmt: skip
    """This process's run written into ``sink`` (a team's watch counting its bytes; every process agrees that every
    share is written): ``(its share, every share on process 0)``, which process 0 then commits."""
    rank = 0 if team is None else team.rank
    watch = None if team is None else team.progress(total, bar=bar, trim=trim)

    def alone(nbytes: int) -> None:  # noqa: ARG001 - a writer's after(nbytes); a team's watch counts them
        trim()
        if progress is not None:
            progress()

    with stepped(team, "consolidate failed on another process; nothing was committed", watch=watch):
        mine = sink.write(rank, alone if watch is None else watch.advance)
    return mine, ([mine] if team is None else team.to_first(sink.sent(mine)) or [])
