"""Write any planning source as one named safetensors file, one tensor at a time (into the caller's output).

The plan (:func:`fsdp_optim.core.plan.plan`, target: one flat per parameter at world size 1) is made before a
byte is written, so every tensor's name, dtype and shape is known: the header goes first, with checksums of
a fixed width left as zeros, then each tensor is assembled from the source (``assemble_full`` of the plan
restricted to one parameter and key), hashed, written and freed; at the end the header is written again
over the first one, now with the checksums, and is exactly as long. Memory: one state tensor, plus what
the source maps (its ``trim`` runs after every tensor).

:func:`prepare_named_safetensors` checks everything (one plan, the document encoded) before a file exists;
:meth:`NamedWrite.write` streams into a file the caller opened (``disk.local_directory.write_stream``: locked,
journaled, atomic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import IO, Any

import torch

from fsdp_optim.core.checksums import DIGEST_ALGORITHM, digest
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.execute import assemble_full, restrict
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.plan import per_parameter, plan
from fsdp_optim.core.source import Plan, Source
from fsdp_optim.formats.fullstate import FORMAT_VERSION
from fsdp_optim.formats.named_safetensors.document import (
    METADATA_KEY,
    NAMED_CHUNK_BYTES,
    Document,
    Entry,
    Group,
    chunk_digests_needed,
)
from fsdp_optim.formats.safetensors_container import PORTABLE_DTYPES, encode_header
from fsdp_optim.formats.sharded.segments import chunk_digests

__all__ = ["NamedTensor", "NamedWrite", "prepare_named_safetensors", "tensor_checksums"]

_PLACEHOLDER = f"{DIGEST_ALGORITHM}:{'0' * 32}"


@dataclass(frozen=True)
class _Item:
    """One tensor of the file, in writing order: where its bytes come from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    flat: int | None  # target flat index of a sharded entry (assembled from the source), else None
    key: str
    value: torch.Tensor | None = None  # a 0-dim scalar state, known from the plan

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class NamedTensor:
    """One tensor of a file to write: its name, dtype and shape, and ``make()``, which reads or assembles it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def tensor_checksums(tensor: torch.Tensor | None, nbytes: int) -> dict[str, Any]:
    """A named file's ``"tensors"`` entry of ``tensor`` (``{"digest", "chunks"}``); ``None``: the placeholder of the
    same width (a header written before its tensors, filled in once they are)."""
    count = chunk_digests_needed(nbytes)
    if tensor is None:
        return {"digest": _PLACEHOLDER, "chunks": [_PLACEHOLDER] * count}
    chunks = list(chunk_digests(tensor.reshape(-1), NAMED_CHUNK_BYTES)) if count else []  # as the sharded format cuts
    return {"digest": digest(tensor), "chunks": chunks}


@dataclass(frozen=True)
class NamedWrite:
    """A checked plan of a named safetensors file: every tensor's name, dtype and shape, and the document.

    Made by :func:`prepare_named_safetensors` before any file exists; :meth:`write` then streams it into a
    seekable binary file (the caller's atomic, locked output).
    """

    plan: Plan
    document: Document
    items: tuple[_Item, ...]

    def tensors(self) -> list[NamedTensor]:
        """Every tensor of the file in writing order, each made (from the source) only when asked."""
        return [NamedTensor(i.name, i.dtype, i.shape, partial(_produce, self.plan, i)) for i in self.items]

    def write(
        self, f: IO[bytes], *, trim: Callable[[], None] = lambda: None, progress: Callable[[], None] | None = None
    ) -> None:
        """Header with zero checksums, each tensor (made, hashed, written, freed; ``trim`` after each), header again."""
        placeholders = {item.name: _checksums(item, None) for item in self.items}
        first = _header_bytes(self.document, placeholders, self.items)
        start = f.tell()
        f.write(first)
        sums = {}
        for item in self.items:
            tensor = _produce(self.plan, item)
            sums[item.name] = _checksums(item, tensor)
            _write_tensor(f, tensor)
            del tensor
            trim()
            if progress is not None:
                progress()
        final = _header_bytes(self.document, sums, self.items)
        assert len(final) == len(first), "the header changed length when its checksums were filled in"
        end = f.tell()
        f.seek(start)
        f.write(final)
        f.seek(end)


def prepare_named_safetensors(
    source: Source, *, order: Sequence[str], header: Mapping[str, Any] | None = None
) -> NamedWrite:
    """Plan ``source`` as a named safetensors file (see :mod:`.document` for the layout); nothing is read or written.

    Args:
        source: any planning source (a full dict, a sharded checkpoint, a shard set, another safetensors file).
        order: every parameter name, in the order that numbers ids (the model's, or a full dict's id order).
        header: the full dict's ``"fsdp_optim"`` block to keep (default: made from the source, as
            ``consolidate`` makes it).

    Raises ``ValueError``/``TypeError`` for a source the plan refuses, per-rank state (MoE experts: each rank's
    own copy has no single name), a dtype safetensors cannot name, a hyperparameter or scalar that JSON cannot
    hold exactly, or two state entries with one tensor name.
    """
    rank = {name: i for i, name in enumerate(order)}
    target = per_parameter(source, order)
    missing = [f.params[0].name for f in target.flat_params if f.params[0].name not in rank]
    if missing:
        raise ValueError(f"order: parameter '{missing[0]}' of {source.label} is not in the given order")
    the_plan = plan(source, target, order=[rank[f.params[0].name] for f in target.flat_params])
    document, items = _document(the_plan, order, header)
    _header_bytes(document, {item.name: _checksums(item, None) for item in items}, items)  # encodes: refuses early
    return NamedWrite(the_plan, document, tuple(items))


def _document(the_plan: Plan, order: Sequence[str], header: Mapping[str, Any] | None) -> tuple[Document, list[_Item]]:
    """The document and the tensors to write, in param order then state order; everything checked up front."""
    source = the_plan.source
    flats = the_plan.target.flat_params
    per_rank = [f.params[0].name for f in source.flats if f.per_rank]
    if per_rank:
        raise ValueError(
            f"{source.label}: parameter '{per_rank[0]}' has per-rank state (MoE experts: each rank its own copy); "
            "the safetensors format holds one tensor per name; keep such a checkpoint sharded"
        )
    names = [f.params[0].name for f in flats]
    rank = {name: i for i, name in enumerate(order)}
    state: dict[str, tuple[Entry, ...]] = {}
    items: list[_Item] = []
    taken: dict[str, str] = {}
    scalar_keys: set[str] = set()
    for t in sorted(the_plan.flats, key=lambda t: rank[names[t]]):
        name, shape = names[t], flats[t].params[0].shape
        entries = []
        for e in the_plan.flats[t].entries:
            tname = f"{name}/{e.key}"
            if e.kind is StateKind.SHARDED:
                dtype = dtype_from_str(e.dtype, where=f"state '{e.key}' of parameter '{name}'")  # type: ignore[arg-type]
                items.append(_Item(tname, _checked_dtype(dtype, tname), shape, t, e.key))
            elif torch.is_tensor(e.value):
                scalar_keys.add(e.key)
                items.append(_Item(tname, _checked_dtype(e.value.dtype, tname), (), None, e.key, clone_value(e.value)))
            else:
                scalar_keys.add(e.key)
                entries.append(Entry(e.key, e.kind.value, value=e.value))
                continue
            if tname in taken:
                raise ValueError(
                    f"{source.label}: state '{e.key}' of '{name}' and {taken[tname]} both make tensor '{tname}'"
                )
            taken[tname] = f"state '{e.key}' of '{name}'"
            entries.append(Entry(e.key, e.kind.value, tensor=tname))
        state[name] = tuple(entries)
    groups = tuple(
        Group(dict(g.hyperparams), tuple(sorted((names[t] for t in g.flat_indices), key=rank.__getitem__)), g.named)
        for g in the_plan.groups
    )
    if header is None:
        header = {"version": FORMAT_VERSION, "optimizer": source.optimizer, "world_size": source.world_size,
                  "scalar_keys": sorted(scalar_keys)}  # fmt: skip
    shapes = {f.params[0].name: f.params[0].shape for f in flats}
    return Document(source.optimizer, tuple(order), shapes, source.shapes_known, groups, state, header), items


def _checked_dtype(dtype: torch.dtype, name: str) -> torch.dtype:
    if dtype not in PORTABLE_DTYPES:
        expected = sorted(map(str, PORTABLE_DTYPES))
        raise ValueError(f"tensor '{name}' has dtype {dtype}, which safetensors cannot name; expected one of "
                         f"{expected}")
    return dtype


def _produce(the_plan: Plan, item: _Item) -> torch.Tensor:
    if item.flat is None:
        assert item.value is not None, f"{item.name}: a scalar item carries its value"
        return item.value
    return assemble_full(restrict(the_plan, item.flat, item.key))[item.flat][item.key].view(item.shape)


def _checksums(item: _Item, tensor: torch.Tensor | None) -> dict[str, Any]:
    """``{"digest": ..., "chunks": [...]}``; zeros of the same width when ``tensor`` is None (the first header)."""
    return tensor_checksums(tensor, item.nbytes)


def _header_bytes(document: Document, sums: Mapping[str, Any], items: Sequence[_Item]) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8 (as safetensors pads)."""
    metadata = {METADATA_KEY: document.to_json(sums)}
    return encode_header(metadata, ((item.name, item.dtype, item.shape) for item in items))


def _write_tensor(f: Any, tensor: torch.Tensor) -> None:
    data = tensor.detach().contiguous().reshape(-1)
    if data.numel():
        f.write(data.view(torch.uint8).numpy().data)
