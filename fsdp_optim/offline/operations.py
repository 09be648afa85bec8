"""Offline work on checkpoints: no process group, no model.

- :func:`consolidate`: a sharded checkpoint directory -> the full dict, exactly what
  ``gather_full_optim_state_dict`` returns for the same optimizer state (same keys, ids, order, dtypes
  and bits).
- :func:`reshard`: a sharded directory or a full dict -> a sharded directory for ``world_size`` ranks
  that a job of that size loads with no communication (each rank reads its own file).
- Both also take a fairseq/metaseq shard set (any ``*-shard<r>.pt`` file or the path before ``-shard``),
  handed to :mod:`fsdp_optim.fairseq` (which has more options and keeps the files' other keys).

Both adapt their input to a :class:`~fsdp_optim.core.plan.Source`, plan once and execute the plan
(:func:`~fsdp_optim.core.plan.assemble_full`, or :func:`~fsdp_optim.core.plan.cut_rank` once per output rank).

Memory: rank files are memory-mapped and read one FSDP unit at a time; mappings are dropped whenever
the touched pages exceed ``max_mapped_bytes``. ``consolidate`` therefore peaks near the size of the
full dict it returns plus that bound; ``reshard`` writes one output rank at a time and peaks near one
output shard plus that bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.plan import Plan, Source, assemble_full, plan
from fsdp_optim.core.preconditions import check_full_dict, check_world_size
from fsdp_optim.disk.atomic import load_file, new_save_id
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.objects import check_state_dict
from fsdp_optim.formats.fairseq.files import OPTIM_KEY
from fsdp_optim.formats.fairseq.recut import consolidate_set, reshard_set
from fsdp_optim.formats.fullstate import build_full_state
from fsdp_optim.formats.sharded import recut
from fsdp_optim.formats.sharded.byte_ranges import cut_spans
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES, ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import check_buffer_choice
from fsdp_optim.formats.sharded.writer import write_all_or_nothing
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout
from fsdp_optim.offline.publish import checkpoint_output
from fsdp_optim.offline.rank_writes import described, fetched_from, then_sides, write_blocks, write_ranks
from fsdp_optim.offline.sources import NEEDS_LAYOUT, Opened, open_source
from fsdp_optim.offline.whole import (
    check_resharding,
    check_whole_options,
    is_whole,
    whole_model,
    whole_state,
)
from fsdp_optim.offline.whole_file import reshard_whole_file

__all__ = ["consolidate", "load_full_file", "optimizer_of", "reshard", "resolve_layout", "whole_file_state"]

Progress = Callable[[], None] | None  # called once per FSDP unit done (the CLI draws a bar with it)
# A block re-cut holds a group's source and output rank files in memory: at most this much (else unit by unit).
BLOCK_BYTES = 256 << 20


def load_full_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A full dict from a file, memory-mapped (``weights_only=True``); ``ValueError`` if it is something else."""
    full = load_file(path, mmap=True)
    check_full_dict(full, str(path))
    check_state_dict(full, str(path))
    return dict(full)


def consolidate(
    path: str | os.PathLike[str],
    *,
    layout: LayoutLike | None = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    rank: int | None = None,
    with_model: bool | None = None,
) -> dict[str, Any]:
    """The full dict of a sharded checkpoint, without a process group or the model.

    ``path`` is the checkpoint directory (or its manifest). Every rank file's header and every unit's
    checksum are verified as they are read. Returns the dict that ``gather_full_optim_state_dict``
    returned at save time (``{"state", "param_groups", "param_names", "fsdp_optim"}``, all tensors new
    CPU memory), bit for bit. ``progress`` is called after each unit.

    A fairseq/metaseq shard set gives its optimizer's full dict (the wrapper's extras, such as
    ``loss_scale``, kept as keys of it); :func:`fsdp_optim.fairseq.consolidate_shards` gives the rest too.
    A fairscale-native dict file is converted (``layout`` required, see :func:`fsdp_optim.from_fairscale`).
    ``layout``, ``optimizer`` and ``allow_globals`` apply as :mod:`fsdp_optim.offline.sources` says.

    A whole checkpoint (:func:`fsdp_optim.save_checkpoint`) gives the unwrapped model too, in one dict::

        {"model": {"embed.weight": Tensor[11, 6], ..., "head.weight": <embed.weight's tensor>, buffers},
         "optimizer": <the full dict above> (None when saved with optim=None),
         "extra": <saved rank 0's extra>}

    ``model.load_state_dict(out["model"])`` (``strict=True``) loads it into the model without FSDP, and a plain
    optimizer over its ``named_parameters()`` grouped as in the job takes ``out["optimizer"]`` (ids follow the
    groups, as :func:`fsdp_optim.gather_full_optim_state_dict` numbers them); see :mod:`fsdp_optim.offline.whole`.
    ``rank``: whose side file gives ``extra`` (and the buffers, required when they were saved per rank);
    ``with_model=False``: the optimizer's full dict alone, as for an optimizer-only checkpoint. Both apply to a
    whole checkpoint only.
    """
    with open_source(
        path, layout=layout, optimizer=optimizer, allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes
    ) as opened:
        if opened.whole_file is not None:  # consolidate's own output: given back as it was read
            return whole_file_state(opened, rank=rank, with_model=with_model)
        if is_whole(opened.checkpoint) and with_model is not False:
            assert opened.checkpoint is not None, "is_whole() holds for an opened checkpoint only"
            model = whole_model(opened.checkpoint, rank=rank, progress=progress)
            return whole_state(model, optimizer_of(opened, progress))
        check_whole_options(opened.checkpoint, rank)
        if with_model is not None and not is_whole(opened.checkpoint):
            raise ValueError(f"with_model: {opened.label} holds no model weights (not a whole checkpoint)")
        return full_state(opened, progress=progress)


def whole_file_state(opened: Opened, *, rank: int | None, with_model: bool | None) -> dict[str, Any]:
    """A consolidated whole checkpoint file's content (each tensor new memory; tied names one tensor), or with
    ``with_model=False`` its optimizer's full dict."""
    whole = opened.whole_file
    if whole is None:
        raise ValueError(f"{opened.label}: expected consolidate's whole checkpoint file, found a {opened.kind.value}")
    if rank is not None:
        raise ValueError(f"rank: {opened.label} holds one rank's extra (a consolidated file): no rank to choose")
    if with_model is False:
        if whole.optimizer is None:
            raise ValueError(f"with_model: {opened.label} was saved without an optimizer: the model is all it holds")
        return dict(clone_value(whole.optimizer))
    # One deep copy of the three: a tied parameter stays one tensor under both names.
    return dict(clone_value({"model": dict(whole.model), "optimizer": whole.optimizer, "extra": whole.extra}))


def optimizer_of(opened: Opened, progress: Progress) -> dict[str, Any] | None:
    """A whole checkpoint's optimizer as a full dict, ``None`` when it was saved with ``optim=None``."""
    assert opened.checkpoint is not None, "a whole checkpoint is a sharded checkpoint"
    return None if opened.checkpoint.manifest.optimizer is None else full_state(opened, progress=progress)


def full_state(
    opened: Opened, *, progress: Progress = None, fairseq_checkpoint: bool = False, with_model: bool = False
) -> dict[str, Any]:
    """The full dict of an opened source (a shard set's with its extras). For a shard set, ``fairseq_checkpoint``
    gives the whole consolidated fairseq checkpoint instead (every key; the weights with ``with_model``)."""
    if opened.shards is not None:
        out = consolidate_set(opened.shards, with_model=with_model, progress=progress)
        return out if fairseq_checkpoint else out[OPTIM_KEY]
    if opened.named is not None:  # a named safetensors file: the dict it was written from
        return opened.named.full_state()
    if opened.whole_file is not None:  # consolidate's file of a whole checkpoint: its optimizer
        return whole_file_state(opened, rank=None, with_model=False)
    converted = opened.converted()
    if converted is not None:  # a fairscale-native dict: the full dict it was converted into
        return dict(converted)
    if opened.checkpoint is None or opened.source is None or opened.layout is None:
        raise ValueError(opened.why_not_consolidated())
    layout, ckpt = opened.layout, opened.checkpoint
    the_plan = plan(opened.source, layout)
    after_unit = _then(ckpt.trim, progress)
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


def _then(first: Callable[[], None], second: Progress) -> Callable[[], None]:
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


def reshard(
    source: str | os.PathLike[str] | Mapping[str, Any],
    world_size: int,
    out_dir: str | os.PathLike[str] | Location,
    *,
    layout: LayoutLike | None = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    overwrite: bool = False,
    buffers: str = "refuse",
) -> Path:
    """Write ``source`` as a sharded checkpoint for ``world_size`` ranks into ``out_dir``; returns its manifest.

    Args:
        source: a sharded checkpoint directory (any world size), or a full dict / a file holding one, or a
            fairseq/metaseq shard set (written in its own format, see :func:`fsdp_optim.fairseq.reshard_shards`;
            the return value is then ``out_dir``).
        world_size: ranks of the job that will load it; units that were not sharded stay whole.
        out_dir: created if needed; must not be the source directory. An existing checkpoint there
            is replaced atomically (the manifest is written last).
        layout: required for a full source, which does not say how parameters are grouped into FSDP
            units: a sharded checkpoint or layout file of the same model (any world size), its
            :class:`Manifest`, a :class:`~fsdp_optim.core.layout.ModelLayout`, or the FSDP-wrapped model.
        progress: called after each unit of each output rank.
        overwrite: write into ``out_dir`` even if it holds files that are not an fsdp_optim checkpoint's
            (they are kept; without it such a directory is refused with ``ForeignOutputError``).
        buffers: a whole checkpoint whose buffers were saved per rank (they differed across ranks, as BatchNorm's
            running statistics do) goes to another world size only with a choice, as in
            :func:`fsdp_optim.load_checkpoint`: ``"refuse"`` (the default: a ``ValueError`` naming this option),
            ``"rank0"`` (saved rank 0's) or ``"mean"`` (each floating-point buffer's mean across the saved ranks,
            rank 0's of integer and bool buffers); the result holds them once, in rank 0's side file. At the saved
            world size they stay per rank, whatever the choice.

    ``out_dir`` is locked while it is written (a second writer gets ``OutputLockedError``) and must not
    resolve to any input; ``world_size`` is at most :data:`fsdp_optim.core.limits.MAX_WORLD_SIZE`.
    The source is checked against the target once (one plan), then cut once per output rank.
    """
    check_world_size("world_size", world_size)
    write = partial(_reshard_local, source, world_size, layout=layout, optimizer=optimizer,
                    allow_globals=allow_globals, progress=progress, max_mapped_bytes=max_mapped_bytes,
                    overwrite=overwrite, buffers=buffers)  # fmt: skip
    target = where(out_dir)
    here = target.local_path()
    if here is None:  # written locally, each rank file uploaded once written
        with checkpoint_output(out_dir, overwrite=overwrite) as (local, file_done):
            write(local, after_file=file_done)
        return target / MANIFEST_NAME  # type: ignore[return-value]  # shown as its URL
    return write(here)


def _reshard_local(
    source: str | os.PathLike[str] | Mapping[str, Any],
    world_size: int,
    out: Path,
    *,
    layout: LayoutLike | None,
    optimizer: str | None,
    allow_globals: Sequence[str],
    progress: Progress,
    max_mapped_bytes: int,
    overwrite: bool,
    buffers: str,
    after_file: Callable[[Path], None] | None = None,
) -> Path:
    """:func:`reshard` into a local directory; ``after_file(path)`` is called as each rank file is complete."""
    with open_source(
        source, layout=layout, optimizer=optimizer, allow_globals=allow_globals, target=True,
        max_mapped_bytes=max_mapped_bytes,
    ) as opened:
        if opened.shards is not None:
            reshard_set(opened.shards, world_size, out, overwrite=overwrite, progress=progress)
            return out
        return reshard_opened(opened, world_size, out, layout=layout, given=source, progress=progress,
                              overwrite=overwrite, after_file=after_file, buffers=buffers)


def reshard_opened(
    opened: Opened,
    world_size: int,
    out: Path,
    *,
    layout: LayoutLike | None,
    given: Any,
    progress: Progress = None,
    overwrite: bool = False,
    replace_existing: bool = True,
    after_file: Callable[[Path], None] | None = None,
    buffers: str = "refuse",
) -> Path:
    """:func:`reshard` of a source already open (not a shard set: see ``reshard_set``); returns the manifest.
    ``replace_existing=False`` (the CLI): a checkpoint already in ``out`` is refused unless ``overwrite``.
    ``after_file(path)`` is called as each rank file is complete (in the staging directory); ``buffers``: see
    :func:`reshard`."""
    check_world_size("world_size", world_size)
    check_buffer_choice(buffers)
    if opened.checkpoint is not None:
        return _reshard_sharded(
            opened, given, world_size, out, progress, overwrite, replace_existing, after_file, buffers
        )
    layout = opened.target_layout(layout)
    if opened.whole_file is not None and layout is not None:  # weights, optimizer, buffers and extra: a whole one
        return reshard_whole_file(opened.whole_file, world_size, out, layout, given=given, progress=progress,
                                  overwrite=overwrite, replace_existing=replace_existing, after_file=after_file)
    if layout is None or opened.source is None:
        raise ValueError(
            f"layout: resharding a {opened.kind.value} ({opened.label}) needs the model's layout: {NEEDS_LAYOUT}"
        )
    return _reshard_full(
        opened.source, given, world_size, out, layout, progress, overwrite, replace_existing, after_file
    )


def _reshard_sharded(
    opened: Opened, given: Any, world_size: int, out: Path, progress: Progress, overwrite: bool,
    replace_existing: bool, after_file: Callable[[Path], None] | None, buffers: str,
) -> Path:  # fmt: skip
    """A sharded checkpoint re-cut for ``world_size`` ranks: one plan, then one rank file at a time."""
    ckpt = opened.checkpoint
    if ckpt is None or opened.source is None:
        raise ValueError(f"{opened.label}: expected a sharded checkpoint, found a {opened.kind.value}")
    source_dir = where(ckpt.directory).local_path()
    if source_dir is not None and out.exists() and out.resolve() == source_dir.resolve():
        raise ValueError(f"out_dir: {out} is the source checkpoint's directory; write to another directory")
    target = replace(ckpt.manifest.with_world_size(world_size), save_id=new_save_id())
    whole = is_whole(ckpt)  # its weights ride along with the optimizer's keys, its side files are carried
    if whole:
        check_resharding(ckpt, world_size, buffers)
    source = ckpt.whole_source() if whole else opened.source
    the_plan = plan(source, target.layout(0))  # every check, whichever way the ranks are then cut
    write = partial(write_ranks, the_plan, target, after_unit=_then(ckpt.trim, progress), after_file=after_file)
    # Cut unit by unit from ranges fetched ahead, where the location fetches ahead (unless cut by blocks, below).
    write = partial(fetched_from, ckpt, partial(cut_spans, ckpt, the_plan, range(world_size)), write)
    final = described(the_plan, target)
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


def _reshard_full(
    source: Source,
    given: Any,
    world_size: int,
    out: Path,
    layout: LayoutLike,
    progress: Progress,
    overwrite: bool,
    replace_existing: bool,
    after_file: Callable[[Path], None] | None = None,
) -> Path:
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


