"""Writing the rank files of a re-cut (:func:`fsdp_optim.reshard`): unit by unit (:func:`write_ranks`) or by blocks
(:func:`write_blocks`), a source in an object store read from ranges fetched ahead (:func:`fetched_from`), a whole
checkpoint's side files carried after them (:func:`then_sides`). ``after_file(path)`` is told of each rank file once
it is complete (an upload can start then: :func:`fsdp_optim.offline.publish.checkpoint_output`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from fsdp_optim.core.source import Plan
from fsdp_optim.formats.sharded import recut
from fsdp_optim.formats.sharded.byte_ranges import Span
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.writer import RankParts, streamed_parts, write_shard_file
from fsdp_optim.offline.whole import carry_side_files

__all__ = ["planned_manifest", "fetched_from", "then_sides", "write_blocks", "write_ranks"]

Progress = Callable[[], None] | None  # once per shard (a unit's state key) of an output rank, or per rank by blocks


def fetched_from(
    ckpt: ShardedCheckpoint, spans: Callable[[], list[Span]], write: Callable[[Path], Manifest], staging: Path
) -> Manifest:
    """``write(staging)`` reading the source's rank files from ``spans()``, fetched ahead by its location where it
    does (:meth:`ShardedCheckpoint.fetched_ahead`)."""
    with ckpt.fetched_ahead(spans):
        return write(staging)


def then_sides(
    ckpt: ShardedCheckpoint, write: Callable[[Path], Manifest], staging: Path, *, buffers: str = "refuse"
) -> Manifest:
    """``write``'s rank files, then a whole checkpoint's side files and training section (:func:`carry_side_files`;
    ``buffers``: what per-rank buffers become at another world size)."""
    return carry_side_files(ckpt, staging, write(staging), buffers)


def planned_manifest(the_plan: Plan, target: Manifest) -> Manifest:
    """``target``'s manifest as the plan fills it (state entries, groups, optimizer), without files yet."""
    flats = tuple(
        replace(f, state=the_plan.flats[t].entries if t in the_plan.flats else ())
        for t, f in enumerate(target.flat_params)
    )
    return replace(target, optimizer=the_plan.source.optimizer, flat_params=flats, groups=the_plan.groups)


def write_ranks(
    the_plan: Plan, target: Manifest, out: Path, after_unit: Progress, after_file: Callable[[Path], None] | None = None
) -> Manifest:
    """Cut and write every rank file of ``target`` into ``out``, one shard (a unit's state key) at a time, so memory
    holds one shard, never a rank's state (:func:`~fsdp_optim.formats.sharded.writer.streamed_parts`); return the
    manifest (not yet written). ``after_unit`` after each shard, ``after_file(path)`` after each rank file."""
    final = planned_manifest(the_plan, target)
    records = []
    for rank in range(target.world_size):
        parts = streamed_parts(the_plan, final, rank, after_shard=after_unit or (lambda: None))
        records.append(write_shard_file(out, parts, save_id=final.save_id, rank=rank, world_size=final.world_size,
                                        staged=True))  # fmt: skip
        if after_file is not None:
            after_file(out / records[-1].file)
    return replace(final, files=tuple(records))


def write_blocks(
    ckpt: ShardedCheckpoint, blocks: recut.Recut, group: int, target: Manifest, out: Path, progress: Progress,
    after_file: Callable[[Path], None] | None = None,
) -> Manifest:  # fmt: skip
    """Write every rank file of ``target`` into ``out`` by block re-cut (:mod:`fsdp_optim.formats.sharded.recut`),
    ``group`` output ranks at a time; ``progress`` is called after each output rank, ``after_file(path)`` after
    each rank file."""
    records = []
    for rank, tensors in recut.recut_groups(ckpt, blocks, group):
        record = write_shard_file(out, RankParts.of_tensors(tensors), save_id=target.save_id, rank=rank,
                                  world_size=target.world_size, staged=True)  # fmt: skip
        records.append(record)
        if after_file is not None:
            after_file(out / record.file)
        if progress is not None:
            progress()
    return replace(target, files=tuple(records))
