"""``consolidate -o s3://bucket/x/model.safetensors`` by a team of processes: the one file as the parts of ONE
multipart upload (:mod:`fsdp_optim.offline.onefile_parts`), each process putting the parts of its own tensors. The
steps, every one ended by an agreement (a failure anywhere fails every process and completes nothing)::

    every process   opens the source, lays the file out and cuts its parts alike (core/parts.py)  -> agree: the plan
    process 0       refuses an object there (unless overwrite), begins the upload, sends its id  -> agree: begun
    every process   makes its tensors, puts its parts (process 0 holds the part with the header's room); the watch
                    counts bytes and stops all on a failure                                       -> agree: all put
    process 0       gathers every share's checksums and parts, puts the header's part, completes -> agree: committed

Process 0 aborts the upload after any failure it sees (a peer's error, a lost peer, its own), so no object appears
and no part is kept; killed itself, it completes nothing either (its unfinished upload is the bucket's lifecycle
rule's to remove). The object's bytes are those one process writes into a local file.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from fsdp_optim.core.parts import PART_BYTES, PartPlan
from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.multipart import Multipart
from fsdp_optim.job.team import Team
from fsdp_optim.offline.onefile import FileLayout, described
from fsdp_optim.offline.onefile_parts import Share, abort_quietly, commit_parts, layout_parts, open_upload, write_parts
from fsdp_optim.offline.parallel.file_plan import planned

__all__ = ["upload_across"]


def upload_across(
    team: Team, opening: Callable[[], AbstractContextManager[Any]], output: str, *, rank: int | None, no_model: bool,
    inputs: tuple[Any, ...], overwrite: bool, bar: bool, part_bytes: int = PART_BYTES,
) -> str | None:  # fmt: skip
    """The module docstring's steps on this process; ``opening()`` opens the source on each. Returns the report on
    process 0, ``None`` elsewhere."""
    with ExitStack() as stack:
        opened, layout = planned(team, stack, opening, rank=rank, no_model=no_model)
        plan = layout_parts(layout, split_by_bytes([t.nbytes for t in layout.tensors], team.size).runs, part_bytes)
        upload, upload_id = _begun(team, output, inputs=inputs, overwrite=overwrite)
        try:
            _write_and_commit(team, layout, plan, upload, upload_id, opened.trim, bar=bar)
        except BaseException:
            if team.rank == 0:
                abort_quietly(upload, upload_id)
            raise
        return described(layout, layout.size) if team.rank == 0 else None


def _begun(team: Team, output: str, *, inputs: tuple[Any, ...], overwrite: bool) -> tuple[Multipart, str]:
    """The upload begun by process 0 (its checks first), its id on every process, each with its own client."""
    failure: BaseException | None = None
    begun = None
    if team.rank == 0:
        try:
            begun = open_upload(output, inputs=inputs, overwrite=overwrite)
            if begun is None:
                raise ValueError(f"output: {output}: its store takes no multipart uploads")
        except Exception as exc:
            failure = exc
    team.agree(failure, "consolidate: process 0 could not begin the upload; nothing was written")
    upload_id = team.from_first(None if begun is None else begun[1])
    if begun is not None:
        return begun
    parent, name = output.rstrip("/").rsplit("/", 1)
    upload = where(parent).multipart(name)
    if upload is None:
        raise ValueError(f"output: {output}: its store takes no multipart uploads here, though it did on process 0")
    return upload, str(upload_id)


def _write_and_commit(
    team: Team, layout: FileLayout, plan: PartPlan, upload: Multipart, upload_id: str, trim: Callable[[], None], *,
    bar: bool,
) -> None:  # fmt: skip
    """This process's parts put; every share gathered on process 0, which completes the upload; all agree."""
    done = [0]
    watch = team.watch(lambda: done[0], total=layout.size, bar=bar)

    def after(nbytes: int) -> None:
        done[0] += nbytes
        trim()
        watch.check()

    share, failure = Share(), None
    try:
        share = write_parts(layout, plan, team.rank, upload, upload_id, after=after)
    except BaseException as exc:
        failure = exc
    team.settle(watch, failure, "consolidate failed on another process; nothing was committed")
    shares = team.to_first(Share(share.sums, share.parts))  # (the held part stays here)
    failure = None
    if team.rank == 0:
        try:
            commit_parts(layout, upload, upload_id, share, shares or [])
        except Exception as exc:
            failure = exc
    team.agree(failure, "consolidate: the commit failed on process 0")
