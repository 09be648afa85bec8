"""A shard set offline: consolidated into one fairseq-shaped checkpoint, or re-cut into a set for another world
size; each planned once against the set's records and executed one tensor at a time (``restrict``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.execute import assemble_full, cut_rank, restrict
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.layout import clean_path
from fsdp_optim.core.plan import plan
from fsdp_optim.core.preconditions import check_world_size
from fsdp_optim.core.source import Plan
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.local_directory import staged_output
from fsdp_optim.disk.locks import resolve_output
from fsdp_optim.disk.stream_save import Pending, stream_save
from fsdp_optim.formats.fairseq.files import OPTIM_KEY
from fsdp_optim.formats.fairseq.paths import SetClaims
from fsdp_optim.formats.fairseq.shards import WEIGHT, Progress, ShardSetReader
from fsdp_optim.formats.fullstate import build_full_state
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES


def consolidate_set(shards: ShardSetReader, *, with_model: bool = False, progress: Progress = None) -> dict[str, Any]:
    """The shard set as one fairseq-shaped checkpoint, no process group, no model::

        {"last_optimizer_state": {"state": {id: {"exp_avg": Tensor[*shape], "step": tensor(7.)}},
                                  "param_groups": [...], "param_names": {id: name}, "fsdp_optim": {...},
                                  "loss_scale": 128.0},          # the wrapper's extras, as fairseq keeps them
         "model": {"embed.weight": Tensor[11, 6], ...},         # only with with_model=True
         "cfg": ..., "optimizer_history": ..., "extra_state": ..., ...}   # every other key of rank 0's file

    ``last_optimizer_state`` without the extras is what ``gather_full_optim_state_dict`` returns for the same
    state when ``param_order`` and ``optimizer`` are given (see :class:`ShardSetReader`). The metadata key is
    dropped: it describes the sharding, which the result no longer has. All tensors are new CPU memory.
    """
    layout = shards.manifest.layout(0)
    the_plan = plan(shards.source(), layout)
    states = {}
    for t in the_plan.flats:
        states.update(assemble_full(restrict(the_plan, t)))
        shards.trim()
        if progress is not None:
            progress()
    full = build_full_state(layout, the_plan.groups, states, optimizer=shards.manifest.optimizer)
    rank0 = shards.rank0()
    full.update({k: copy.deepcopy(rank0[OPTIM_KEY][k]) for k in shards.extras})
    out: dict[str, Any] = {}
    for key, value in rank0.items():
        if key == OPTIM_KEY:
            out[key] = full
        elif key == "model":
            if with_model:
                out[key] = shards.full_weights(rank0, progress=progress)
        elif key != shards.metadata_key:
            out[key] = copy.deepcopy(value)
    return out



def reshard_shards(
    path: str | os.PathLike[str],
    world_size: int,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    optimizer_keys: Sequence[Sequence[str]] | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
) -> list[Path]:
    """Write the shard set as ``world_size`` files ``{prefix}-shard{r}.pt`` into ``out_dir``; returns their paths.

    Each file has the source's keys: ``model`` (every backing parameter's padded shard for ``world_size``
    ranks, buffers and tied names as in the source), ``last_optimizer_state`` (the same ids, param groups and
    extras, each state tensor cut for the rank), the metadata with each rank's padding, and every other key
    of rank 0's file unchanged (``cfg`` still says the old world size: fairseq takes it from the command
    line). A fairscale FSDP job of ``world_size`` ranks loads them with ``load_local_state_dict`` and
    ``optimizer.load_state_dict``.

    ``out_dir``: not the source's directory; written all or nothing, locked (``OutputLockedError``). Shard files of
    the same name there are refused (``ForeignOutputError``) unless ``overwrite=True``, which replaces them and
    removes those of ranks beyond ``world_size``; other files there are never touched. Memory: one unit's shard and
    the mapping bound.
    """
    check_world_size("world_size", world_size)
    with ShardSetReader(
        path, optimizer_keys=optimizer_keys, allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes
    ) as shards:
        return reshard_set(shards, world_size, Path(out_dir), overwrite=overwrite, progress=progress)



def reshard_set(
    shards: ShardSetReader, world_size: int, out: Path, *, overwrite: bool = False, progress: Progress = None
) -> list[Path]:
    """:func:`reshard_shards` of a set already open."""
    check_world_size("world_size", world_size)
    name = shards.prefix.name
    if resolve_output(out) == resolve_output(shards.prefix.parent):
        raise ValueError(f"out_dir: {out} holds the source shards; write to another directory")
    target = shards.manifest.with_world_size(world_size)
    weights = shards.weights.with_world_size(world_size)
    opt_plan = plan(shards.source(), target.layout(0))
    w_plan = plan(shards.weights_source(), weights.layout(0))
    rank0 = shards.rank0()
    purpose = f"fsdp_optim.fairseq.reshard_shards -> {world_size} ranks"
    out.parent.mkdir(parents=True, exist_ok=True)
    entry = JournalEntry(world_size=world_size)
    with staged_output(out, SetClaims(name), purpose=purpose, overwrite=overwrite, entry=entry) as stage:
        for rank in range(world_size):
            stream_save(
                _rank_file(shards, rank0, rank, opt_plan, w_plan, progress),
                stage.dir / f"{name}-shard{rank}.pt",
                after_tensor=shards.trim,
            )
    return [out / f"{name}-shard{rank}.pt" for rank in range(world_size)]



def _rank_file(
    shards: ShardSetReader, rank0: Mapping[str, Any], rank: int, opt_plan: Plan, w_plan: Plan, progress: Progress
) -> dict[str, Any]:
    """Rank ``rank``'s file as an object whose tensors are :class:`Pending` cuts (written one at a time)."""

    def cut(the_plan: Plan, t: int, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Pending:
        def produce() -> torch.Tensor:
            tensor = cut_rank(restrict(the_plan, t, key), rank)[t][key].view(shape)
            if progress is not None:
                progress()
            return tensor

        return Pending(shape, dtype, produce)

    def shape_of(t: int) -> tuple[int, ...]:
        flat = opt_plan.target.flat_params[t]
        if flat.world_size == 1 and not flat.flattened:
            return flat.params[0].shape  # an unsharded, unflattened parameter keeps its shape
        return (flat.bounds(rank if flat.world_size > 1 else 0).numel,)

    weights = {t: cut(w_plan, t, WEIGHT, shape_of(t), w_plan.target.flat_params[t].dtype) for t in w_plan.flats}
    model: dict[str, Any] = {}
    for key, value in rank0["model"].items():
        if key in shards.keys:
            model[key] = weights[shards.keys.index(key)]
        elif key in shards.model_aliases:
            model[key] = weights[shards.keys.index(shards.model_aliases[key])]
        else:
            model[key] = value  # a buffer: replicated, carried from rank 0
    saved = rank0[OPTIM_KEY]
    state: dict[Any, Any] = {}
    for t, flat_plan in opt_plan.flats.items():
        entries = {}
        for e in flat_plan.entries:
            if e.kind is StateKind.SCALAR:
                entries[e.key] = clone_value(e.value)
            else:
                entries[e.key] = cut(opt_plan, t, e.key, shape_of(t), getattr(torch, str(e.dtype)))
        state[shards.id_of_flat[t]] = entries
    state = {pid: state[pid] for pid in saved["state"] if pid in state}
    optim = {k: (state if k == "state" else copy.deepcopy(v)) for k, v in saved.items()}
    meta = copy.deepcopy(rank0[shards.metadata_key])
    for t, b in enumerate(shards.backings):
        flat = opt_plan.target.flat_params[t]
        padding = flat.bounds(rank if flat.world_size > 1 else 0).padding
        meta["param_metadata"][b.instance]["params"][_backing_name(meta, b)]["padding"] = padding
    out = {}
    for key, value in rank0.items():
        out[key] = {"model": model, OPTIM_KEY: optim, shards.metadata_key: meta}.get(key, value)
    return out



def _backing_name(meta: Mapping[str, Any], backing: Any) -> str:
    params = meta["param_metadata"][backing.instance]["params"]
    return next(name for name in params if clean_path(name) == backing.name)
