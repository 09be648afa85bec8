"""Offline work on checkpoints: no process group, no model.

- :func:`consolidate`: a sharded checkpoint directory -> the full dict, exactly what
  ``gather_full_optim_state_dict`` returns for the same optimizer state (same keys, ids, order, dtypes
  and bits).
- :func:`reshard`: a sharded directory or a full dict -> a sharded directory for ``world_size`` ranks
  that a job of that size loads with no communication (each rank reads its own file).
- Both also take a fairseq/metaseq shard set (any ``*-shard<r>.pt`` file or the path before ``-shard``),
  handed to :mod:`fsdp_optim.fairseq` (which has more options and keeps the files' other keys).

Both adapt their input to a :class:`~fsdp_optim.plan.Source`, plan once and execute the plan
(:func:`~fsdp_optim.plan.assemble_full`, or :func:`~fsdp_optim.plan.cut_rank` once per output rank).

Memory: rank files are memory-mapped and read one FSDP unit at a time; mappings are dropped whenever
the touched pages exceed ``max_mapped_bytes``. ``consolidate`` therefore peaks near the size of the
full dict it returns plus that bound; ``reshard`` writes one output rank at a time and peaks near one
output shard plus that bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_optim.core.plan import Plan, assemble_full, cut_rank, plan
from fsdp_optim.core.preconditions import check_full_dict, check_world_size
from fsdp_optim.disk.atomic import load_file, new_save_id
from fsdp_optim.disk.untrusted import check_state_dict
from fsdp_optim.formats.fairseq.files import OPTIM_KEY, is_shard_set
from fsdp_optim.formats.fairseq.shards import consolidate_shards, reshard_shards
from fsdp_optim.formats.fullstate import build_full_state, full_dict_source
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import (
    DEFAULT_MAPPED_BYTES,
    ShardedCheckpoint,
    checkpoint_dir,
    source_kind,
)
from fsdp_optim.formats.sharded.writer import write_all_or_nothing, write_shard_file
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout

__all__ = ["consolidate", "load_full_file", "reshard", "resolve_layout"]

Progress = Callable[[], None] | None  # called once per FSDP unit done (the CLI draws a bar with it)


def load_full_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A full dict from a file, memory-mapped (``weights_only=True``); ``ValueError`` if it is something else."""
    full = load_file(path, mmap=True)
    check_full_dict(full, str(path))
    check_state_dict(full, str(path))
    return dict(full)


def consolidate(
    path: str | os.PathLike[str], *, progress: Progress = None, max_mapped_bytes: int = DEFAULT_MAPPED_BYTES
) -> dict[str, Any]:
    """The full dict of a sharded checkpoint, without a process group or the model.

    ``path`` is the checkpoint directory (or its manifest). Every rank file's header and every unit's
    checksum are verified as they are read. Returns the dict that ``gather_full_optim_state_dict``
    returned at save time (``{"state", "param_groups", "param_names", "fsdp_optim"}``, all tensors new
    CPU memory), bit for bit. ``progress`` is called after each unit.

    A fairseq/metaseq shard set gives its optimizer's full dict (the wrapper's extras, such as
    ``loss_scale``, kept as keys of it); :func:`fsdp_optim.fairseq.consolidate_shards` gives the rest too.
    """
    if is_shard_set(path):
        return consolidate_shards(path, progress=progress, max_mapped_bytes=max_mapped_bytes)[OPTIM_KEY]
    with ShardedCheckpoint(path, max_mapped_bytes=max_mapped_bytes) as ckpt:
        layout = ckpt.manifest.layout(0)
        the_plan = plan(ckpt.source(), layout)
        after_unit = _then(ckpt.trim, progress)
        flat_states = assemble_full(the_plan, after_unit=after_unit)
        per_rank = None
        if layout.per_rank_units():  # MoE experts: every rank's own copy, from its own file
            per_rank = {r: assemble_full(the_plan, after_unit=after_unit, per_rank=r) for r in range(layout.world_size)}
    return build_full_state(layout, the_plan.groups, flat_states, optimizer=ckpt.manifest.optimizer, per_rank=per_rank)


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
    out_dir: str | os.PathLike[str],
    *,
    layout: LayoutLike | None = None,
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    overwrite: bool = False,
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
            :class:`Manifest`, a :class:`ModelLayout`, or the FSDP-wrapped model.
        progress: called after each unit of each output rank.
        overwrite: write into ``out_dir`` even if it holds files that are not an fsdp_optim checkpoint's
            (they are kept; without it such a directory is refused with ``ForeignOutputError``).

    ``out_dir`` is locked while it is written (a second writer gets ``OutputLockedError``) and must not
    resolve to any input; ``world_size`` is at most :data:`fsdp_optim.untrusted.MAX_WORLD_SIZE`.
    The source is checked against the target once (one plan), then cut once per output rank.
    """
    check_world_size("world_size", world_size)
    out = Path(out_dir)
    if not isinstance(source, Mapping) and is_shard_set(source):
        if layout is not None:
            raise ValueError("layout: a fairseq/metaseq shard set carries its own layout (its metadata)")
        reshard_shards(
            source, world_size, out, overwrite=overwrite, progress=progress, max_mapped_bytes=max_mapped_bytes
        )
        return out
    if not isinstance(source, Mapping) and source_kind(source) == "sharded":
        if layout is not None:
            raise ValueError("layout: a sharded source carries its own layout; pass layout only with a full dict")
        return _reshard_sharded(source, world_size, out, progress, max_mapped_bytes, overwrite)
    if layout is None:
        raise ValueError(
            f"layout: resharding a full dict ({source if not isinstance(source, Mapping) else 'dict'}) needs the "
            "model's layout: a sharded checkpoint or layout file of the same model, or the FSDP model"
        )
    return _reshard_full(source, world_size, out, layout, progress, overwrite)


def _reshard_sharded(
    source: str | os.PathLike[str],
    world_size: int,
    out: Path,
    progress: Progress,
    max_mapped_bytes: int,
    overwrite: bool,
) -> Path:
    """A sharded checkpoint re-cut for ``world_size`` ranks: one plan, then one rank file at a time."""
    if out.exists() and out.resolve() == checkpoint_dir(source).resolve():
        raise ValueError(f"out_dir: {out} is the source checkpoint's directory; write to another directory")
    with ShardedCheckpoint(source, max_mapped_bytes=max_mapped_bytes) as ckpt:
        target = replace(ckpt.manifest.with_world_size(world_size), save_id=new_save_id())
        the_plan = plan(ckpt.source(), target.layout(0))
        return write_all_or_nothing(
            out,
            lambda staging: _write_ranks(the_plan, target, staging, _then(ckpt.trim, progress)),
            save_id=target.save_id,
            world_size=world_size,
            inputs=(source,),
            overwrite=overwrite,
        )


def _reshard_full(
    source: str | os.PathLike[str] | Mapping[str, Any],
    world_size: int,
    out: Path,
    layout: LayoutLike,
    progress: Progress,
    overwrite: bool,
) -> Path:
    """A full dict (in memory or a file) cut for ``world_size`` ranks of ``layout``: one plan, then one rank at a
    time."""
    label = "the full dict" if isinstance(source, Mapping) else str(source)
    full = source if isinstance(source, Mapping) else load_full_file(source)
    target = Manifest.from_layout(resolve_layout(layout), save_id=new_save_id()).with_world_size(world_size)
    the_plan = plan(full_dict_source(full, label=label), target.layout(0))
    return write_all_or_nothing(
        out,
        lambda staging: _write_ranks(the_plan, target, staging, progress),
        save_id=target.save_id,
        world_size=world_size,
        inputs=(source, layout),
        overwrite=overwrite,
    )


def _write_ranks(the_plan: Plan, target: Manifest, out: Path, after_unit: Progress) -> Manifest:
    """Cut and write every rank file of ``target`` into ``out``; return the manifest (not yet written)."""
    records = []
    for rank in range(target.world_size):
        state = cut_rank(the_plan, rank, after_unit=after_unit)
        records.append(write_shard_file(out, state, save_id=target.save_id, rank=rank, world_size=target.world_size))
        del state
    flats = tuple(
        replace(f, state=the_plan.flats[t].entries if t in the_plan.flats else ())
        for t, f in enumerate(target.flat_params)
    )
    return replace(
        target, optimizer=the_plan.source.optimizer, flat_params=flats, groups=the_plan.groups, files=tuple(records)
    )
