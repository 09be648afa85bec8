"""The planned work behind ``consolidate`` and ``reshard``, on the readers themselves (no opened input): a sharded
checkpoint assembled into its full dict (:func:`consolidate_checkpoint`), a sharded checkpoint re-cut for another
world size (:func:`reshard_checkpoint`) and a full source cut for a layout (:func:`reshard_full`; consolidate's file
of a whole checkpoint too, its weights riding along as ``@param``, its buffers and ``extra`` in the side files: rank 0
gets the buffers, every rank the file's one ``extra``). Each plans once (:func:`~fsdp_optim.core.plan.plan`) and
executes the plan: whole rank files as rows when the units are the checkpoint's own and a group of them fits
:data:`BLOCK_BYTES` (:func:`write_blocks`), else one shard at a time (:func:`write_ranks`). ``after_file(path)`` is
told of each rank file once it is complete (an upload can start then:
:func:`fsdp_optim.offline.publish.checkpoint_output`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.execute import assemble_full
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.plan import plan
from fsdp_optim.core.source import Plan, Source
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.location import same_place
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.fullstate import build_full_state
from fsdp_optim.formats.sharded import recut
from fsdp_optim.formats.sharded.byte_ranges import cut_spans
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import encode_extra, write_side_file
from fsdp_optim.formats.sharded.streamed import streamed_parts
from fsdp_optim.formats.sharded.training import BufferSpec, TrainingRecord
from fsdp_optim.formats.sharded.writer import RankParts, write_all_or_nothing, write_shard_file
from fsdp_optim.formats.whole_file import WholeFile
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout
from fsdp_optim.offline.whole import carry_side_files, check_resharding, is_whole

__all__ = [
    "BLOCK_BYTES", "consolidate_checkpoint", "planned_manifest", "reshard_checkpoint", "reshard_full", "write_blocks",
    "write_ranks",
]  # fmt: skip

Progress = Callable[[], None] | None  # called once per FSDP unit done (the CLI draws a bar with it)
AfterFile = Callable[[Path], None] | None  # called as each output rank file is complete
# A block re-cut holds a group's source and output rank files in memory: at most this much (else unit by unit).
BLOCK_BYTES = 256 << 20


def consolidate_checkpoint(
    ckpt: ShardedCheckpoint, source: Source, layout: ModelLayout, progress: Progress
) -> dict[str, Any]:
    """The full dict of the sharded checkpoint ``ckpt`` (``source``, ``layout``: its own), bit for bit what
    ``gather_full_optim_state_dict`` returned; ``progress`` after each unit."""
    the_plan = plan(source, layout)
    after_unit = then(ckpt.trim, progress)
    flat_states = _blocks_of(the_plan, ckpt, after_unit) or assemble_full(the_plan, after_unit=after_unit)
    per_rank = None
    if layout.per_rank_units():  # MoE experts: every rank's own copy, from its own file
        per_rank = {r: assemble_full(the_plan, after_unit=after_unit, per_rank=r) for r in range(layout.world_size)}
    return build_full_state(layout, the_plan.groups, flat_states, optimizer=ckpt.manifest.optimizer, per_rank=per_rank)


def _blocks_of(the_plan: Plan, ckpt: ShardedCheckpoint, after_unit: Callable[[], None]) -> dict[int, dict[str, Any]]:
    """:func:`assemble_full`'s result read as whole rank files (:func:`recut.full_flats`) when the plan's units are
    the checkpoint's own and the rows fit :data:`BLOCK_BYTES`; empty otherwise."""
    if not recut.same_units(ckpt, the_plan.target.flat_params):
        return {}
    flats = recut.full_flats(ckpt, BLOCK_BYTES)
    if flats is None:
        return {}
    out = {}
    for t, flat_plan in the_plan.flats.items():
        out[t] = {
            e.key: flats[(t, e.key)] if e.kind is StateKind.SHARDED else clone_value(e.value) for e in flat_plan.entries
        }
        after_unit()
    return out


def then(first: Callable[[], None], second: Progress) -> Callable[[], None]:
    """``first``, then ``second`` when there is one."""
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


def reshard_checkpoint(
    ckpt: ShardedCheckpoint, source: Source, given: Any, world_size: int, out: Path, progress: Progress,
    overwrite: bool, replace_existing: bool, after_file: AfterFile, buffers: str,
) -> Path:  # fmt: skip
    """The sharded checkpoint ``ckpt`` (``source``: its optimizer state) re-cut for ``world_size`` ranks into
    ``out``: one plan, then one rank file at a time (a whole one carries its weights and side files)."""
    if out.exists() and same_place(ckpt.directory, where(out)):
        raise ValueError(f"out_dir: {out} is the source checkpoint's directory; write to another directory")
    target = replace(ckpt.manifest.with_world_size(world_size), save_id=new_save_id())
    whole = is_whole(ckpt)  # its weights ride along with the optimizer's keys, its side files are carried
    if whole:
        check_resharding(ckpt, world_size, buffers)
    the_plan = plan(ckpt.whole_source() if whole else source, target.layout(0))  # every check, whichever the cut
    final = planned_manifest(the_plan, target)
    blocks = recut.Recut.of(ckpt, final) if recut.applicable(ckpt, final) else None
    group = recut.group_size(blocks, ckpt.layout[1], BLOCK_BYTES) if blocks is not None else 0

    def write(staging: Path) -> Manifest:
        if blocks is not None and group:
            manifest = write_blocks(ckpt, blocks, group, final, staging, progress, after_file)
        else:  # unit by unit, from ranges fetched ahead where the location fetches ahead
            with ckpt.fetched_ahead(partial(cut_spans, ckpt, the_plan, range(world_size))):
                manifest = write_ranks(the_plan, target, staging, then(ckpt.trim, progress), after_file)
        return carry_side_files(ckpt, staging, manifest, buffers) if whole else manifest

    return write_all_or_nothing(out, write, save_id=target.save_id, world_size=world_size, inputs=(given,),
                                overwrite=overwrite, replace=replace_existing)  # fmt: skip


def reshard_full(
    source: Source | WholeFile, given: Any, world_size: int, out: Path, layout: LayoutLike, progress: Progress,
    overwrite: bool, replace_existing: bool, after_file: AfterFile = None,
) -> Path:  # fmt: skip
    """A full dict (in memory or a file) cut for ``world_size`` ranks of ``layout``: one plan, then one rank at a
    time; consolidate's file of a whole checkpoint (a :class:`WholeFile`) as a whole sharded checkpoint (see the
    module docstring). ``ValueError`` when the source does not fit the layout."""
    model = resolve_layout(layout)
    target = Manifest.from_layout(model, save_id=new_save_id()).with_world_size(world_size)
    whole = None
    if isinstance(source, WholeFile):  # the file names no units: the layout names its parameters
        whole = WholeFile.of({"model": source.model, "optimizer": source.optimizer, "extra": source.extra},
                             source.label, params=model.param_order if source.optimizer is None else None)  # fmt: skip
        source = whole.whole_source()
    the_plan = plan(source, target.layout(0))  # every check: names, shapes, groups

    def write(staging: Path) -> Manifest:
        manifest = write_ranks(the_plan, target, staging, progress, after_file)
        return manifest if whole is None else _whole_sides(whole, staging, manifest)

    return write_all_or_nothing(out, write, save_id=target.save_id, world_size=world_size, inputs=(given, layout),
                                overwrite=overwrite, replace=replace_existing)  # fmt: skip


def _whole_sides(whole: WholeFile, staging: Path, manifest: Manifest) -> Manifest:
    """A consolidated file's side files: rank 0 the buffers, every rank the file's ``extra``."""
    buffers = whole.buffer_tensors()
    specs = tuple(BufferSpec(n, tuple(t.shape), dtype_to_str(t.dtype)) for n, t in buffers.items())
    files = tuple(
        write_side_file(staging, save_id=manifest.save_id, rank=rank, world_size=manifest.world_size,
                        buffers=buffers if rank == 0 else {}, extra=encode_extra(whole.extra))  # fmt: skip
        for rank in range(manifest.world_size)
    )
    return replace(manifest, training=TrainingRecord(specs, False, whole.aliases, files))


def planned_manifest(the_plan: Plan, target: Manifest) -> Manifest:
    """``target``'s manifest as the plan fills it (state entries, groups, optimizer), without files yet."""
    flats = tuple(
        replace(f, state=the_plan.flats[t].entries if t in the_plan.flats else ())
        for t, f in enumerate(target.flat_params)
    )
    return replace(target, optimizer=the_plan.source.optimizer, flat_params=flats, groups=the_plan.groups)


def write_ranks(
    the_plan: Plan, target: Manifest, out: Path, after_unit: Progress, after_file: AfterFile = None
) -> Manifest:
    """Cut and write every rank file of ``target`` into ``out``, one shard (a unit's state key) at a time, so memory
    holds one shard, never a rank's state (:func:`~fsdp_optim.formats.sharded.streamed.streamed_parts`); return the
    manifest (not yet written). ``after_unit`` after each shard."""
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
    after_file: AfterFile = None,
) -> Manifest:  # fmt: skip
    """Write every rank file of ``target`` into ``out`` by block re-cut (:mod:`fsdp_optim.formats.sharded.recut`),
    ``group`` output ranks at a time; ``progress`` after each output rank."""
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
