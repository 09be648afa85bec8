"""``reshard`` of our sharded checkpoint by a team of processes (:class:`~fsdp_optim.job.team.Team`).

The steps, every one ended by an agreement (a failure anywhere fails every process, and nothing is committed)::

    every process   opens the source, plans alike (process 0's save id)    -> agree: the plan
    every process   enters the one save driver (disk/save.py ``saving``, a local directory's RenameWriter)
    process 0       begins the save: lock, recover, journal, staging dir    -> agree: the output; its staging dir sent
    every process   lays out the output rank files it owns (core/split.py split_stream: the file's first data byte
                    is in its share): created at its size, the header with placeholder digests written
                                                                            -> agree: every file laid out
    every process   writes its share of the files' data (equal shares of all the files' bytes, cut on chunk
                    boundaries: a file may be written by several) at its offsets, one piece at a time, hashed as
                    it is written, and its chunks' digests into their header slots (formats/sharded/ranged.py);
                    the watch counts bytes and stops all on a failure             -> agree: every share written
    every process   checks the headers of the files it owns (every digest filled in) and makes their records
                                                                            -> agree: every file finished
    process 0       gathers the records, carries a whole checkpoint's side files, makes the manifest and moves the
                    files in (``save.publish``)                             -> agree: the files in place
    process 0       ``save.commit``: the manifest renamed into place, last  -> agree: the commit

The output must be a directory every process sees (a shared file system): process 0 locks and journals it, so a run
killed anywhere is undone by the next writer, as for one process. The files are those one process writes: the same
names (but for the save id) and the same bytes (the same header encoder, the same chunk digests, whoever made them).
Each process reads only the source ranges its share needs: two processes share at most a chunk of the source where
their shares meet.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.plan import plan
from fsdp_optim.core.source import Plan
from fsdp_optim.core.split import StreamSplit, split_stream
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.local_directory import staged_writer
from fsdp_optim.disk.save import Save, saving
from fsdp_optim.formats.sharded.byte_ranges import Span, read_spans
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.ranged import LaidOutFile, finished_record, laid_out, lay_out_file, write_rank
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES, chunk_elements, file_layout, manifest_shards
from fsdp_optim.formats.sharded.writer import CHECKPOINT
from fsdp_optim.job.team import Team
from fsdp_optim.offline.cuts import planned_manifest
from fsdp_optim.offline.parallel.stretches import ChunkRun, FileLayout, chunk_runs, cut_piece, piece_reads
from fsdp_optim.offline.whole import carry_side_files, check_resharding, is_whole

__all__ = ["Planned", "plan_reshard", "reshard_across", "share_spans"]


@dataclass(frozen=True)
class Planned:
    """A re-cut as every process plans it: the plan, the target manifest it fills (no files yet), whether the
    checkpoint is whole, where each shard lies in every output file, and the files' bytes split over the processes."""

    plan: Plan
    final: Manifest
    whole: bool
    layout: FileLayout
    split: StreamSplit

    def share(self, process: int) -> list[ChunkRun]:
        """What ``process`` writes: its stretches of the output files as runs of chunks of their tensors."""
        return chunk_runs(self.layout, self.split.stretches(process))


def plan_reshard(ckpt: ShardedCheckpoint, world_size: int, save_id: str, processes: int, buffers: str) -> Planned:
    """The plan of re-cutting ``ckpt`` for ``world_size`` ranks, and the output files' data split over
    ``processes`` (:func:`~fsdp_optim.core.split.split_stream`): pure of the process, so every process makes the
    same."""
    target = replace(ckpt.manifest.with_world_size(world_size), save_id=save_id)
    whole = is_whole(ckpt)
    if whole:
        check_resharding(ckpt, world_size, buffers)
    the_plan = plan(ckpt.whole_source() if whole else ckpt.source(), target.layout(0))
    final = planned_manifest(the_plan, target)
    layout = file_layout(manifest_shards(final.flat_params, ShardIndex.of(final.flat_params)))
    items = {name: dtype_from_str(name, where="state").itemsize for name in layout[1]}
    tensors = [(n * items[name], chunk_elements(dtype_from_str(name, where="state"), CHUNK_BYTES) * items[name])
               for name, n in layout[1].items()]  # fmt: skip
    return Planned(the_plan, final, whole, layout, split_stream(world_size, tensors, processes))


def share_spans(ckpt: ShardedCheckpoint, planned: Planned, runs: Sequence[ChunkRun]) -> list[Span]:
    """The source ranges (chunk-widened, headers included) that writing ``runs`` reads, in order of use."""
    reads = ((run.rank, (source, piece.key, first, last)) for run in runs for piece in run.pieces
             for source, _, first, last in piece_reads(planned.plan, run.rank, piece))  # fmt: skip
    return read_spans(ckpt, reads)


def reshard_across(
    team: Team, ckpt: ShardedCheckpoint, world_size: int, out: Path, *, given: Any, overwrite: bool,
    replace_existing: bool, buffers: str, bar: bool,
) -> Path:  # fmt: skip
    """The module docstring's steps on this process; returns the committed manifest's path (on every process)."""
    save_id = team.from_first(new_save_id())
    planned: Planned | None = None
    with team.step("reshard: planning failed; nothing was written"):
        planned = plan_reshard(ckpt, world_size, save_id, team.size, buffers)
    assert planned is not None, "the plan agreed on exists"
    entry = JournalEntry(save_id=planned.final.save_id, world_size=planned.final.world_size)
    writer = staged_writer(out, CHECKPOINT, inputs=(given,), replace=replace_existing, entry=entry,
                           commit_name=MANIFEST_NAME)  # fmt: skip
    with saving(writer, None, save_id=save_id, rank=team.rank, agreed=team.step) as save:
        staging = _open_output(team, save, out, overwrite=overwrite)
        records = _share(team, ckpt, planned, staging, bar=bar)
        gathered, data, names = team.to_first(records), None, list[str]()
        with team.step("reshard: process 0 could not make the manifest; nothing was committed"):
            if gathered is not None:  # process 0: the manifest (and a whole checkpoint's side files), files moved in
                manifest = _manifest(ckpt, planned, gathered, staging, buffers)
                data, names = manifest_to_json(manifest), sorted(os.listdir(staging))
                save.publish(names)
        save.commit(data, keep=names)  # process 0 renames the manifest into place, last
    return out / MANIFEST_NAME


def _open_output(team: Team, save: Save, out: Path, *, overwrite: bool) -> Path:
    """Process 0 begins the save at ``out`` (lock, recovery, journal, staging directory); every process agrees that
    it did, and learns the staging directory that every process writes into."""
    with team.step(f"reshard: the output {out} could not be opened; nothing was written"):
        if team.rank == 0:
            save.begin(purpose="reshard", overwrite=overwrite)
            save.staging.path.stat()  # (made now, before any process looks for it)
    return Path(team.from_first(str(save.staging.path) if team.rank == 0 else None))


def _manifest(
    ckpt: ShardedCheckpoint, planned: Planned, gathered: Sequence[list[FileRecord]], staging: Path, buffers: str
) -> Manifest:
    """Process 0: the manifest of every share's records (and a whole checkpoint's side files, written into
    ``staging`` now)."""
    files = tuple(sorted((r for share in gathered for r in share), key=lambda r: r.rank))
    assert [f.rank for f in files] == list(range(planned.final.world_size)), "every output rank was written once"
    manifest = replace(planned.final, files=files)
    if planned.whole:
        manifest = carry_side_files(ckpt, staging, manifest, buffers)
    return manifest


def _share(team: Team, ckpt: ShardedCheckpoint, planned: Planned, staging: Path, *, bar: bool) -> list[FileRecord]:
    """This process's part of the module docstring's three share steps, each agreed by every process; the records
    of the files it owns."""
    owned = [laid_out(planned.final, rank) for rank in planned.split.owned(team.rank)]
    with team.step("reshard: the output files could not be laid out; nothing was committed"):
        if not staging.is_dir():
            raise ValueError(f"{staging}: process 0's staging directory is not visible here: the output must be on a "
                             "file system every process shares")  # fmt: skip
        for layout in owned:
            lay_out_file(staging / layout.name, layout)
    _write_share(team, ckpt, planned, staging, bar=bar)
    records: list[FileRecord] = []
    with team.step("reshard: a written rank file did not check; nothing was committed"):
        records = [finished_record(staging / layout.name, layout) for layout in owned]
    return records


def _write_share(team: Team, ckpt: ShardedCheckpoint, planned: Planned, staging: Path, *, bar: bool) -> None:
    """This process's runs written into the laid-out files, one piece at a time; every process agrees that every
    share is written before any returns."""
    runs = planned.share(team.rank)
    watch = team.progress(planned.split.file_bytes * planned.split.outputs, bar=bar, trim=ckpt.trim)
    with team.step("reshard failed on another process; nothing was committed", watch=watch):
        layout: LaidOutFile | None = None
        with ckpt.fetched_ahead(lambda: share_spans(ckpt, planned, runs)):
            for run in runs:
                if layout is None or layout.rank != run.rank:
                    layout = laid_out(planned.final, run.rank)
                write_rank(staging / layout.name, layout, {run.name: _cut(planned, run)},
                           span=(run.tensor, run.start, run.stop), after=watch.advance)  # fmt: skip


def _cut(planned: Planned, run: ChunkRun) -> Iterator[torch.Tensor]:
    """The pieces of ``run``, each cut when the writer asks for it."""
    read = planned.plan.source.reader(run.rank)
    dtype = dtype_from_str(run.name, where="state")
    for piece in run.pieces:
        yield cut_piece(planned.plan, run.rank, piece, dtype, read)
