"""The planned work behind ``consolidate`` and ``reshard``, on the readers themselves (no opened input): a sharded
checkpoint assembled into its full dict (:func:`consolidate_checkpoint`), a sharded checkpoint re-cut for another
world size (:func:`reshard_checkpoint`) and a full source cut for a layout (:func:`reshard_full`). Each plans once
(:func:`~fsdp_optim.core.plan.plan`) and executes the plan: whole rank files as rows when the units are the
checkpoint's own and a group of them fits :data:`BLOCK_BYTES`, else one FSDP unit at a time.

The opened classes of :mod:`fsdp_optim.offline.opened` call these for their kind; :mod:`fsdp_optim.offline.operations`
calls the classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

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
from fsdp_optim.formats.sharded.writer import write_all_or_nothing
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout
from fsdp_optim.offline.rank_writes import fetched_from, planned_manifest, then_sides, write_blocks, write_ranks
from fsdp_optim.offline.whole import check_resharding, is_whole

__all__ = ["BLOCK_BYTES", "consolidate_checkpoint", "reshard_checkpoint", "reshard_full"]

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
    write = partial(write_ranks, the_plan, target, after_unit=then(ckpt.trim, progress), after_file=after_file)
    # Cut unit by unit from ranges fetched ahead, where the location fetches ahead (unless cut by blocks, below).
    write = partial(fetched_from, ckpt, partial(cut_spans, ckpt, the_plan, range(world_size)), write)
    final = planned_manifest(the_plan, target)
    if recut.applicable(ckpt, final):
        blocks = recut.Recut.of(ckpt, final)
        group = recut.group_size(blocks, ckpt.layout[1], BLOCK_BYTES)
        if group:
            write = partial(write_blocks, ckpt, blocks, group, final, progress=progress, after_file=after_file)
    if whole:
        write = partial(then_sides, ckpt, write, buffers=buffers)
    return write_all_or_nothing(
        out,
        write,
        save_id=target.save_id,
        world_size=world_size,
        inputs=(given,),
        overwrite=overwrite,
        replace=replace_existing,
    )


def reshard_full(
    source: Source, given: Any, world_size: int, out: Path, layout: LayoutLike, progress: Progress, overwrite: bool,
    replace_existing: bool, after_file: AfterFile = None,
) -> Path:  # fmt: skip
    """A full dict (in memory or a file) cut for ``world_size`` ranks of ``layout``: one plan, then one rank at a
    time."""
    target = Manifest.from_layout(resolve_layout(layout), save_id=new_save_id()).with_world_size(world_size)
    the_plan = plan(source, target.layout(0))
    return write_all_or_nothing(
        out,
        lambda staging: write_ranks(the_plan, target, staging, progress, after_file),
        save_id=target.save_id,
        world_size=world_size,
        inputs=(given, layout),
        overwrite=overwrite,
        replace=replace_existing,
    )
