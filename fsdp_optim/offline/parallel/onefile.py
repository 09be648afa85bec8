"""``consolidate -o FILE.safetensors`` by a team of processes (:class:`~fsdp_optim.job.team.Team`): one file, laid
out before any byte (:func:`~fsdp_optim.offline.onefile.lay_out`), each process writing its share of the tensors
into it at their offsets. The steps, every one ended by an agreement (a failure anywhere fails every process, and
nothing is committed)::

    every process   opens the source, lays the file out alike                    -> agree: the layout
    process 0       opens the output (disk/staged.py write_stream: lock, journal, a temporary file beside it),
                    preallocates the temporary file, sends its path             (None: it failed -> agree: its error)
    every process   writes its run of tensors (split by bytes, core/split.py, in file order) at their offsets, reads
                    each back, fsyncs; the watch counts bytes and stops all on a failure
                                                                                 -> agree: every share written
    process 0       gathers every share's checksums, writes the header over its planned room, fsyncs and renames
                                                                                 -> agree: the commit

The bytes are those one process writes (the layout, the tensors and their checksums do not depend on who wrote
them). The output must be on a file system every process sees. A process killed anywhere: the others fail within
the team's timeout; process 0 removes the temporary file (killed itself, the next writer's recovery does).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any, BinaryIO

from fsdp_optim.core.split import Split, split_by_bytes
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.staged import write_stream
from fsdp_optim.job.team import PeerFailed, Team
from fsdp_optim.offline.onefile import FileLayout, described, preallocate, write_header, write_tensors
from fsdp_optim.offline.parallel.file_plan import planned

__all__ = ["consolidate_across"]


def consolidate_across(
    team: Team, opening: Callable[[], AbstractContextManager[Any]], output: str | os.PathLike[str], *,
    rank: int | None, no_model: bool, inputs: tuple[Any, ...], overwrite: bool, bar: bool,
) -> str | None:  # fmt: skip
    """The module docstring's steps on this process; ``opening()`` opens the source (and checks the output) on
    each. Returns the report (:func:`~fsdp_optim.offline.onefile.described`) on process 0, ``None`` elsewhere."""
    if where(str(output)).shared_directory() is None:  # written whole by one writer: the parts of one multipart upload
        from fsdp_optim.offline.parallel.upload import upload_across

        return upload_across(team, opening, str(output), rank=rank, no_model=no_model, inputs=inputs,
                             overwrite=overwrite, bar=bar)  # fmt: skip
    with ExitStack() as stack:
        opened, layout = planned(team, stack, opening, rank=rank, no_model=no_model)
        split = split_by_bytes([t.nbytes for t in layout.tensors], team.size)
        if team.rank != 0:
            _other(team, layout, split, opened.trim, bar=bar)
            return None
        size = _first(team, layout, split, output, opened.trim, inputs=inputs, overwrite=overwrite, bar=bar)
        return described(layout, size)


def _first(
    team: Team, layout: FileLayout, split: Split, output: str | os.PathLike[str], trim: Callable[[], None], *,
    inputs: tuple[Any, ...], overwrite: bool, bar: bool,
) -> int:  # fmt: skip
    """Process 0: the output opened, its share written, the header written and the file committed; the file's size."""
    phase = ["open"]

    def write(f: BinaryIO) -> None:
        preallocate(f.fileno(), layout.size)
        phase[0] = "share"
        team.from_first(f.name)
        sums = _share(team, f.name, layout, split, trim, bar=bar)
        phase[0] = "commit"
        write_header(f.fileno(), layout, team.to_first(sums) or [])

    try:
        size = write_stream(write, output, inputs=inputs, purpose="fsdp_optim.consolidate", overwrite=overwrite)
    except BaseException as exc:
        if phase[0] == "open":  # the others wait for the temporary file's path: none, then the error
            team.from_first(None)
        if phase[0] != "share":  # a share's failure was agreed on there already
            team.agree(exc, f"consolidate: process 0 could not write {output}; nothing was committed")
        raise
    team.agree(None, "consolidate: the commit failed on process 0")
    return size


def _other(team: Team, layout: FileLayout, split: Split, trim: Callable[[], None], *, bar: bool) -> None:
    """Any process but 0: its share written into process 0's temporary file, its checksums sent to process 0."""
    path = team.from_first(None)
    if path is None:
        team.agree(None, "consolidate: process 0 could not open the output; nothing was written")
        raise RuntimeError("consolidate: process 0 failed to open the output")  # agree raised its error already
    team.to_first(_share(team, path, layout, split, trim, bar=bar))
    team.agree(None, "consolidate: the commit failed on process 0")


def _share(
    team: Team, path: str, layout: FileLayout, split: Split, trim: Callable[[], None], *, bar: bool
) -> dict[str, Any]:
    """This process's run of tensors written at their offsets in ``path`` and read back; every process agrees that
    every share is done before any returns. Returns this share's checksums by tensor name."""
    done = [0]
    watch = team.watch(lambda: done[0], total=layout.size, bar=bar)

    def after(nbytes: int) -> None:
        done[0] += nbytes
        trim()
        watch.check()

    sums: dict[str, Any] = {}
    failure: BaseException | None = None
    try:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: process 0's temporary file is not visible here: the output must be on a file "
                             "system every process shares")  # fmt: skip
        sums = write_tensors(path, layout, split.runs[team.rank], after=after)
    except BaseException as exc:
        failure = exc
    try:
        watch.finish(failure)
    except PeerFailed as exc:
        failure = exc
    team.agree(failure, "consolidate failed on another process; nothing was committed")
    return sums
