"""``reshard`` of our sharded checkpoint by a team of processes (:class:`~fsdp_optim.job.team.Team`).

The steps, every one ended by an agreement (a failure anywhere fails every process, and nothing is committed)::

    every process   opens the source, plans alike (process 0's save id)    -> agree: the plan
    process 0       opens the output: lock, recover, journal, staging dir   -> agree: the output; its staging dir sent
    every process   writes its run of output rank files (core/split.py) into the staging dir, one shard at a time,
                    reads each back against its checksums; the watch counts bytes and stops all on a failure
                                                                            -> agree: every share written and verified
    process 0       gathers the records, carries a whole checkpoint's side files, moves the files in and writes the
                    manifest last (disk/staged.py, the one way out)         -> agree: the commit

The output must be a directory every process sees (a shared file system): process 0 locks and journals it, so a run
killed anywhere is undone by the next writer, as for one process. The files are those one process writes: the same
names (but for the save id) and the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.plan import Plan, plan
from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.staged import Stage, staged_output
from fsdp_optim.formats.sharded.byte_ranges import cut_spans
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.rank_file import host_pieces
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.store_prefetch import fetched_ahead
from fsdp_optim.formats.sharded.streamed import check_written, rank_file_bytes, write_streamed
from fsdp_optim.formats.sharded.writer import CHECKPOINT, write_manifest
from fsdp_optim.job.team import Team
from fsdp_optim.offline.rank_writes import described
from fsdp_optim.offline.whole import carry_side_files, check_resharding, is_whole

__all__ = ["Planned", "plan_reshard", "reshard_across"]


@dataclass(frozen=True)
class Planned:
    """A re-cut as every process plans it: the plan, the target manifest it fills (no files yet), whether the
    checkpoint is whole, and the output ranks each process writes."""

    plan: Plan
    final: Manifest
    whole: bool
    runs: tuple[tuple[int, ...], ...]


def plan_reshard(ckpt: ShardedCheckpoint, world_size: int, save_id: str, processes: int, buffers: str) -> Planned:
    """The plan of re-cutting ``ckpt`` for ``world_size`` ranks, and the output ranks split over ``processes``
    (:func:`~fsdp_optim.core.split.split_by_bytes`): pure of the process, so every process makes the same."""
    target = replace(ckpt.manifest.with_world_size(world_size), save_id=save_id)
    whole = is_whole(ckpt)
    if whole:
        check_resharding(ckpt, world_size, buffers)
    the_plan = plan(ckpt.whole_source() if whole else ckpt.source(), target.layout(0))
    final = described(the_plan, target)
    split = split_by_bytes([rank_file_bytes(final)] * world_size, processes)
    return Planned(the_plan, final, whole, split.runs)


def reshard_across(
    team: Team, ckpt: ShardedCheckpoint, world_size: int, out: Path, *, given: Any, overwrite: bool,
    replace_existing: bool, buffers: str, bar: bool,
) -> Path:  # fmt: skip
    """The module docstring's steps on this process; returns the committed manifest's path (on every process)."""
    failure: BaseException | None = None
    planned = None
    save_id = team.from_first(new_save_id())
    try:
        planned = plan_reshard(ckpt, world_size, save_id, team.size, buffers)
    except Exception as exc:
        failure = exc
    team.agree(failure, "reshard: planning failed; nothing was written")
    assert planned is not None, "the plan agreed on exists"
    with ExitStack() as stack:  # a failure in here undoes the output (process 0) and is raised by every process
        stage = _open_output(team, stack, out, given, planned, overwrite=overwrite, replace_existing=replace_existing)
        staging = Path(team.from_first(None if stage is None else stage.dir))
        records = _share(team, ckpt, planned, staging, bar=bar)
        gathered = team.to_first(records)
        if stage is not None:
            assert gathered is not None, "process 0 gathers the records"
            try:
                stage.commit = _commit(ckpt, planned, gathered, staging, buffers)
            except Exception as exc:
                failure = exc
        team.agree(failure, "reshard: process 0 could not make the manifest; nothing was committed")
        committing = stack.pop_all()
    try:  # process 0 moves the files in and writes the manifest last (or fails and undoes it)
        committing.close()
    except BaseException as exc:
        failure = exc
    team.agree(failure, "reshard: the commit failed on process 0")
    return out / MANIFEST_NAME


def _open_output(
    team: Team, stack: ExitStack, out: Path, given: Any, planned: Planned, *, overwrite: bool, replace_existing: bool
) -> Stage | None:
    """Process 0 opens ``out`` (lock, recovery, journal, staging directory) within ``stack``; every process agrees
    that it did. Its :class:`Stage` on process 0, ``None`` elsewhere."""
    failure: BaseException | None = None
    stage = None
    if team.rank == 0:
        entry = JournalEntry(save_id=planned.final.save_id, world_size=planned.final.world_size)
        try:
            opened = staged_output(out, CHECKPOINT, purpose="reshard", inputs=(given,), overwrite=overwrite,
                                   replace=replace_existing, entry=entry)
            stage = stack.enter_context(opened)
        except Exception as exc:
            failure = exc
    team.agree(failure, f"reshard: the output {out} could not be opened; nothing was written")
    return stage


def _commit(
    ckpt: ShardedCheckpoint, planned: Planned, gathered: Sequence[list[FileRecord]], staging: Path, buffers: str
) -> Callable[[Path], Path]:
    """Process 0: the manifest of every share's records (and a whole checkpoint's side files, written into
    ``staging`` now), as the commit that writes it last."""
    files = tuple(sorted((r for share in gathered for r in share), key=lambda r: r.rank))
    assert [f.rank for f in files] == list(range(planned.final.world_size)), "every output rank was written once"
    manifest = replace(planned.final, files=files)
    if planned.whole:
        manifest = carry_side_files(ckpt, staging, manifest, buffers)
    return lambda target: write_manifest(target, manifest)


def _share(team: Team, ckpt: ShardedCheckpoint, planned: Planned, staging: Path, *, bar: bool) -> list[FileRecord]:
    """This process's run of output rank files written into ``staging`` and read back; every process agrees that
    every share is done before any returns."""
    ranks = planned.runs[team.rank]
    done = [0]

    def counted(parts: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        for piece in host_pieces(parts):
            yield piece
            done[0] += piece.numel()

    total = rank_file_bytes(planned.final) * planned.final.world_size
    watch = team.watch(lambda: done[0], total=total, bar=bar)

    def after_shard() -> None:
        ckpt.trim()
        watch.check()

    records: list[FileRecord] = []
    failure: BaseException | None = None
    try:
        if not staging.is_dir():
            raise ValueError(f"{staging}: process 0's staging directory is not visible here: the output must be on a "
                             "file system every process shares")  # fmt: skip
        with fetched_ahead(ckpt, lambda: cut_spans(ckpt, planned.plan, ranks)):
            for rank in ranks:
                record = write_streamed(staging, planned.plan, planned.final, rank, after_shard=after_shard,
                                        pieces=counted)  # fmt: skip
                check_written(staging / record.file, record)
                records.append(record)
    except BaseException as exc:
        failure = exc
    team.settle(watch, failure, "reshard failed on another process; nothing was committed")
    return records
