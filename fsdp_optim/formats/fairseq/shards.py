"""A fairseq / metaseq shard set as a planning source, twice: the optimizer's state (:meth:`ShardSetReader.source`)
and the model's weights (:meth:`ShardSetReader.weights_source`, one entry ``"param"``). No model, no process group:
the layout comes from the files' own metadata (:mod:`.files`)::

    shards -> ShardSetReader -> Source (flats = backing parameters at N ranks)
           -> plan(source, same units at M ranks)      -> cut_rank per rank, one unit at a time -> M files
           -> plan(source, same units at world size N) -> assemble_full -> build_full_state  -> full dict
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.execute import assemble_full, restrict
from fsdp_optim.core.flatten import StateKind, split
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.source import Source
from fsdp_optim.formats.fairseq.checks import (
    ParamOrder,
    check_same_save,
    check_shards,
    fairseq_state_entries,
    model_aliases,
    optimizer_ids,
    resolve_param_order,
)
from fsdp_optim.formats.fairseq.files import OPTIM_KEY, RankSummary, load_shard, summarise
from fsdp_optim.formats.fairseq.optimizers import torch_optimizer
from fsdp_optim.formats.fairseq.paths import shard_paths
from fsdp_optim.formats.sharded.manifest import Manifest, manifest_source
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES

__all__ = ["WEIGHT", "ShardSetReader"]

WEIGHT = "param"  # the one state key of the weights source
Progress = Callable[[], None] | None


class ShardSetReader:
    """A fairseq/metaseq shard set opened for reading: checked records and reads of any element range.

    Opening reads every file's outline, one file mapped at a time, and refuses a missing shard, shards of
    different saves or models, and metadata that does not match the tensors. Reads map the files; :meth:`trim`
    drops the mappings once the bytes touched exceed ``max_mapped_bytes``.

    Args:
        path: any shard file of the set, or the path before ``-shard``.
        param_order: the unwrapped model's parameter names in ``named_parameters()`` order, which numbers the full
            dict's parameters as ``gather_full_optim_state_dict`` does (the files do not record it; default: the
            files' order, ``parameters()`` of the wrapped model).
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

    def _records(self, first: RankSummary) -> tuple[list[FlatRecord], list[FlatRecord], tuple[GroupRecord, ...]]:
        """The optimizer's and the weights' flat records, one per backing parameter, and the param groups."""
        flats, weight_flats = [], []
        for i, b in enumerate(self.backings):
            model_dtype = first.model[b.key][1]
            entries = fairseq_state_entries(first, self.id_of_flat.get(i), b.key)
            dtype = next((getattr(torch, str(e.dtype)) for e in entries if e.kind is StateKind.SHARDED), model_dtype)
            record = FlatRecord(b.unit, b.params, self.world_size, None, dtype, flattened=b.flattened)
            flats.append(replace(record, state=entries))
            weight = StateEntry(WEIGHT, StateKind.SHARDED, dtype=dtype_to_str(model_dtype))
            weight_flats.append(replace(record, dtype=model_dtype, state=(weight,)))
        flat_of_id = {pid: i for i, pid in self.id_of_flat.items()}
        groups = tuple(
            GroupRecord(
                {k: v for k, v in hyper.items() if k != "param_names"},
                tuple(flat_of_id[pid] for pid in ids),
                named="param_names" in hyper,
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

    def __enter__(self) -> ShardSetReader:
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




