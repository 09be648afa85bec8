"""fairseq / metaseq shard sets as a planning source, and what to do with them offline: consolidate, reshard.

No model, no process group: the layout comes from the files' own metadata (format and loading policy in
:mod:`fsdp_optim.fairseq_format`). :class:`ShardSet` checks a set once and exposes it twice, as the
optimizer's state (:meth:`ShardSet.source`, one state entry per optimizer state key) and as the model's
weights (:meth:`ShardSet.weights_source`, one entry ``"param"``), so the engine plans and cuts both::

    shards -> ShardSet -> Source (flats = backing parameters at N ranks)
           -> plan(source, same units at M ranks)      -> cut_rank per rank, one unit at a time -> M files
           -> plan(source, same units at world size N) -> assemble_full -> build_full_state  -> full dict

- :func:`consolidate_shards`: the set as one fairseq-shaped checkpoint: ``last_optimizer_state`` is our full
  dict (what ``gather_full_optim_state_dict`` returns, plus the wrapper's extras such as ``loss_scale``),
  ``model`` the full weights by unwrapped name (``with_model=True``), and every other key of rank 0's file.
- :func:`reshard_shards`: M files in the same format and names; each written one tensor at a time
  (:func:`~fsdp_optim.fairseq_write.stream_save`), so memory stays near one unit's shard plus the mapping bound.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.flatten import StateKind, clone_value, split
from fsdp_optim.core.layout import clean_path
from fsdp_optim.core.plan import Plan, Source, assemble_full, cut_rank, plan, restrict
from fsdp_optim.core.preconditions import check_world_size
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.disk.locks import resolve_output
from fsdp_optim.disk.staged import staged_output
from fsdp_optim.disk.stream_save import Pending, stream_save
from fsdp_optim.formats.fairseq.checks import (
    ParamOrder,
    check_same_save,
    check_shards,
    model_aliases,
    optimizer_ids,
    resolve_param_order,
    state_entries,
)
from fsdp_optim.formats.fairseq.files import (
    METADATA_KEYS,
    OPTIM_KEY,
    RankSummary,
    SetClaims,
    is_shard_set,
    load_shard,
    shard_paths,
    summarise,
)
from fsdp_optim.formats.fairseq.optimizers import torch_optimizer
from fsdp_optim.formats.fullstate import build_full_state
from fsdp_optim.formats.sharded.manifest import Manifest, manifest_source
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES

__all__ = ["METADATA_KEYS", "OPTIM_KEY", "ShardSet", "consolidate_shards", "is_shard_set", "reshard_shards"]

WEIGHT = "param"  # the one state key of the weights source
Progress = Callable[[], None] | None


class ShardSet:
    """A fairseq/metaseq shard set opened for reading: checked records and reads of any element range.

    Opening reads every file's outline, one file mapped at a time, and refuses (naming the file, unit or
    parameter, expected vs found) a missing shard, shards of different saves or models, and metadata that
    does not match the tensors. Reads map the files and drop the mappings in :meth:`trim` once the bytes
    touched exceed ``max_mapped_bytes``.

    Args:
        path: any shard file of the set, or the path before ``-shard``.
        param_order: the unwrapped model's parameter names in ``named_parameters()`` order (a list, the
            unwrapped or fairscale-wrapped model, or a layout file / sharded checkpoint of ours), which numbers
            the full dict's parameters as ``gather_full_optim_state_dict`` does. The files do not record it;
            by default parameters follow the files' order (``parameters()`` of the wrapped model).
        optimizer_keys: per param group, the ``model`` keys (``"block1.flat_param_0"``) of the optimizer's
            parameters in its order; needed only when the sizes leave the ids ambiguous.
        allow_globals: classes (``"module.Class"``) to allow when loading, besides plain data.
        optimizer: the optimizer's class name for the full dict's header. ``None``: the ``torch.optim`` class
            whose state the optimizer the files record keeps (``FairseqAdam``: ``AdamW``; see
            :mod:`~fsdp_optim.formats.fairseq.optimizers`), refusing shape-dependent ones (Adafactor); for an
            optimizer not known there, unknown and not checked.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        param_order: ParamOrder = None,
        optimizer_keys: Sequence[Sequence[str]] | None = None,
        allow_globals: Sequence[str] = (),
        optimizer: str | None = None,
        max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    ) -> None:
        self.prefix, self.paths = shard_paths(path)
        self.label = f"{self.prefix}-shard*.pt"
        self.allow_globals = tuple(allow_globals)
        self.max_mapped_bytes = max_mapped_bytes
        summaries = [summarise(load_shard(p, allow_globals=self.allow_globals), p) for p in self.paths]
        check_same_save(summaries)
        first = summaries[0]
        self.world_size = len(self.paths)
        self.metadata_key = first.metadata_key
        self.extras = first.extras
        self.buffers, self.unsaved_buffers = first.buffers, first.unsaved_buffers  # unsaved: non-persistent
        # The files' order: the model dict's, which is the wrapped model's parameters() order.
        position = {key: i for i, key in enumerate(first.model)}
        missing = next((b.key for b in first.backings if b.key not in position), None)
        if missing is not None:
            raise ValueError(f"{first.path}: 'model' has no '{missing}', which the metadata describes")
        order = sorted(range(len(first.backings)), key=lambda i: position[first.backings[i].key])
        self.backings = tuple(first.backings[i] for i in order)
        self.keys = tuple(b.key for b in self.backings)
        self.full_on = check_shards(summaries, order)
        self.model_aliases = model_aliases(first, self.keys)
        self.aliases = dict(first.aliases)  # unwrapped alias -> parameter (flattened units' shared_param_info)
        self.id_of_flat = optimizer_ids(first, self.backings, self.world_size, optimizer_keys, self.label)
        flats, weight_flats, groups = self._records(first)
        self.recorded_optimizer = first.optimizer  # (class, registered name) as fairseq / metaseq record them
        if optimizer is None:  # the torch.optim class whose state it keeps; shape-dependent ones are refused
            optimizer = torch_optimizer(*first.optimizer, where=self.label)
        names = resolve_param_order(param_order, [p.name for b in self.backings for p in b.params], self.label)
        self.manifest = Manifest("fairseq", optimizer, self.world_size, names, tuple(flats), groups)
        self.manifest.check(source=self.label)
        self.weights = replace(
            self.manifest, flat_params=tuple(weight_flats), groups=(GroupRecord({}, tuple(range(len(flats)))),)
        )
        self._files: list[Any] = [None] * self.world_size
        self._mapped = 0
        self.peak_mapped = 0

    def _records(self, first: RankSummary) -> tuple[list[FlatRecord], list[FlatRecord], tuple[GroupRecord, ...]]:
        """The optimizer's and the weights' flat records, one per backing parameter, and the param groups."""
        flats, weight_flats = [], []
        for i, b in enumerate(self.backings):
            model_dtype = first.model[b.key][1]
            entries = state_entries(first, self.id_of_flat.get(i), b.key)
            dtype = next((getattr(torch, str(e.dtype)) for e in entries if e.kind is StateKind.SHARDED), model_dtype)
            record = FlatRecord(b.unit, b.params, self.world_size, None, dtype, b.flattened)
            flats.append(replace(record, state=entries))
            weight = StateEntry(WEIGHT, StateKind.SHARDED, dtype=dtype_to_str(model_dtype))
            weight_flats.append(replace(record, dtype=model_dtype, state=(weight,)))
        flat_of_id = {pid: i for i, pid in self.id_of_flat.items()}
        groups = tuple(
            GroupRecord(
                {k: v for k, v in hyper.items() if k != "param_names"},
                tuple(flat_of_id[pid] for pid in ids),
                "param_names" in hyper,
            )
            for hyper, ids in first.groups
        )
        return flats, weight_flats, groups

    # -- sources and reads -----------------------------------------------------------------------------

    def source(self) -> Source:
        """The optimizer state as a planning source."""
        return manifest_source(self.manifest, self.label, self.read_state)

    def weights_source(self) -> Source:
        """The model's weights as a planning source: one sharded entry ``"param"`` per backing parameter."""
        return manifest_source(self.weights, self.label, self.read_weights)

    def read_state(self, flat: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        pid = self.id_of_flat[flat]
        self._copy(flat, start, stop, out, lambda r: self._file(r)[OPTIM_KEY]["state"][pid][key], whole=False)

    def read_weights(self, flat: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        assert key == WEIGHT, f"a weights plan has the one entry '{WEIGHT}', asked for {key!r}"
        self._copy(flat, start, stop, out, lambda r: self._file(r)["model"][self.keys[flat]], whole=True)

    def _copy(
        self, flat: int, start: int, stop: int, out: torch.Tensor, tensor: Callable[[int], Any], *, whole: bool
    ) -> None:
        record = self.manifest.flat_params[flat]
        for rank in range(record.world_size):
            bounds = record.layout(rank).bounds()
            lo, hi = max(start, bounds.start), min(stop, bounds.stop)
            if lo < hi:
                # fairscale leaves an unflattened parameter that forward never used whole on every rank.
                first = 0 if whole and (flat, rank) in self.full_on else bounds.start
                out[lo - start : hi - start].copy_(tensor(rank).reshape(-1)[lo - first : hi - first])
                self._mapped += (hi - lo) * out.element_size()
                self.peak_mapped = max(self.peak_mapped, self._mapped)

    def _file(self, rank: int) -> Any:
        if self._files[rank] is None:
            self._files[rank] = load_shard(self.paths[rank], allow_globals=self.allow_globals)
        return self._files[rank]

    def rank0(self) -> Mapping[str, Any]:
        """Rank 0's file, mapped on its own (its pages are not trimmed with the reads')."""
        return load_shard(self.paths[0], allow_globals=self.allow_globals)

    def trim(self) -> None:
        """Drop the file mappings if the bytes touched since the last drop exceed ``max_mapped_bytes``; hand
        freed heap pages back to the system (callers run this after each tensor they made and let go of)."""
        if self._mapped > self.max_mapped_bytes:
            self.close()
        _release_heap()

    def close(self) -> None:
        self._files = [None] * self.world_size
        self._mapped = 0

    def __enter__(self) -> ShardSet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- whole weights ---------------------------------------------------------------------------------

    def full_weights(self, rank0: Mapping[str, Any], *, progress: Progress = None) -> dict[str, torch.Tensor]:
        """The unwrapped model's state dict: parameters (tied names too) and buffers, new CPU memory."""
        layout = self.weights.layout(0)
        the_plan = plan(self.weights_source(), layout)
        out: dict[str, torch.Tensor] = {}
        for t in the_plan.flats:
            flat_full = assemble_full(restrict(the_plan, t))[t][WEIGHT]
            out.update(zip(layout.flat_params[t].names, split(layout.flat_params[t], flat_full)))
            self.trim()
            if progress is not None:
                progress()
        out.update({alias: out[name] for alias, name in self.aliases.items()})
        out.update({alias: out[self.full_name(key)] for alias, key in self.model_aliases.items()})
        out.update({name: rank0["model"][name].clone() for name in self.buffers})
        return out

    def full_name(self, key: str) -> str:
        """The unwrapped name of an unflattened backing parameter's ``model`` key."""
        return self.backings[self.keys.index(key)].params[0].name


def _release_heap() -> None:
    """``malloc_trim(0)`` where the C library has it (glibc). glibc raises its mmap threshold to the size of the
    largest block freed, so every later tensor of a unit's size comes from the heap, and freed heap pages stay
    resident: a streaming writer's RSS would creep up by several tensors without this."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # pragma: no cover - not glibc
        return None


_LIBC = _libc()


# ---------------------------------------------------------------------------------------------------
# Offline operations


def consolidate_shards(
    path: str | os.PathLike[str],
    *,
    with_model: bool = False,
    param_order: ParamOrder = None,
    optimizer: str | None = None,
    optimizer_keys: Sequence[Sequence[str]] | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
) -> dict[str, Any]:
    """The shard set as one fairseq-shaped checkpoint, no process group, no model::

        {"last_optimizer_state": {"state": {id: {"exp_avg": Tensor[*shape], "step": tensor(7.)}},
                                  "param_groups": [...], "param_names": {id: name}, "fsdp_optim": {...},
                                  "loss_scale": 128.0},          # the wrapper's extras, as fairseq keeps them
         "model": {"embed.weight": Tensor[11, 6], ...},         # only with with_model=True
         "cfg": ..., "optimizer_history": ..., "extra_state": ..., ...}   # every other key of rank 0's file

    ``last_optimizer_state`` without the extras is what ``gather_full_optim_state_dict`` returns for the same
    state when ``param_order`` and ``optimizer`` are given (see :class:`ShardSet`). The metadata key is
    dropped: it describes the sharding, which the result no longer has. All tensors are new CPU memory.
    """
    with ShardSet(
        path,
        param_order=param_order,
        optimizer_keys=optimizer_keys,
        allow_globals=allow_globals,
        optimizer=optimizer,
        max_mapped_bytes=max_mapped_bytes,
    ) as shards:
        return consolidate_set(shards, with_model=with_model, progress=progress)


def consolidate_set(shards: ShardSet, *, with_model: bool, progress: Progress = None) -> dict[str, Any]:
    """:func:`consolidate_shards` of a set already open (its optimizer name and order are the set's)."""
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

    ``out_dir`` must not be the source's directory, and is locked while written (a second writer gets
    ``OutputLockedError``). Shard files of the same name already there are refused (``ForeignOutputError``)
    unless ``overwrite=True``, which replaces them and removes those of ranks beyond ``world_size`` (so no
    mixed set is left); other files there are never touched. All-or-nothing: the set is checked and planned
    first, the files are written into a staging directory beside ``out_dir`` and moved in only when all are
    complete. Memory: one unit's shard and the mapping bound.
    """
    check_world_size("world_size", world_size)
    with ShardSet(
        path, optimizer_keys=optimizer_keys, allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes
    ) as shards:
        return reshard_set(shards, world_size, Path(out_dir), overwrite=overwrite, progress=progress)


def reshard_set(
    shards: ShardSet, world_size: int, out: Path, *, overwrite: bool = False, progress: Progress = None
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
    entry = {"world_size": world_size}
    with staged_output(out, SetClaims(name), purpose=purpose, overwrite=overwrite, entry=entry) as stage:
        for rank in range(world_size):
            stream_save(
                _rank_file(shards, rank0, rank, opt_plan, w_plan, progress),
                stage.dir / f"{name}-shard{rank}.pt",
                after_tensor=shards.trim,
            )
    return [out / f"{name}-shard{rank}.pt" for rank in range(world_size)]


def _rank_file(
    shards: ShardSet, rank0: Mapping[str, Any], rank: int, opt_plan: Plan, w_plan: Plan, progress: Progress
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
