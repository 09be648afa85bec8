"""Write any planning source as one named safetensors file, one tensor at a time (into the caller's output).

The plan (target: one flat per parameter at world size 1) is made before a byte is written, so the header goes
first with checksums of a fixed width left as zeros; each tensor is then assembled from the source, hashed,
written and freed; the header is written again over the first, now with the checksums, exactly as long.
Memory: one state tensor, plus what the source maps (its ``trim`` runs after every tensor).
"""

from __future__ import annotations

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
from fsdp_optim.formats.safetensors_container import Tensor, check_portable, data_bytes, encode_header
from fsdp_optim.formats.sharded.segments import chunk_digests

__all__ = ["NamedWrite", "prepare_named_safetensors", "tensor_checksums"]

_PLACEHOLDER = f"{DIGEST_ALGORITHM}:{'0' * 32}"


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
    """A checked plan of a named safetensors file: the document and every tensor in writing order, each made (from
    the source) only when asked. Made by :func:`prepare_named_safetensors` before any file exists."""

    document: Document
    tensors: tuple[Tensor, ...]

    def header(self, sums: Mapping[str, Any] | None) -> bytes:
        """The header (length prefix included); ``sums`` ``None``: checksum placeholders of the same width."""
        if sums is None:
            sums = {t.name: tensor_checksums(None, t.nbytes) for t in self.tensors}
        metadata = {METADATA_KEY: self.document.to_json(sums)}
        return encode_header(metadata, ((t.name, t.dtype, t.shape) for t in self.tensors))

    def write(
        self, f: IO[bytes], *, trim: Callable[[], None] = lambda: None, progress: Callable[[], None] | None = None
    ) -> None:
        """Stream into the seekable ``f`` (the caller's atomic, locked output): header with zero checksums, each
        tensor (made, hashed, written, freed; ``trim`` after each), header again."""
        first = self.header(None)
        start = f.tell()
        f.write(first)
        sums = {}
        for t in self.tensors:
            tensor = t.made()
            sums[t.name] = tensor_checksums(tensor, t.nbytes)
            f.write(data_bytes(tensor))
            del tensor
            trim()
            if progress is not None:
                progress()
        final = self.header(sums)
        assert len(final) == len(first), "the header changed length when its checksums were filled in"
        end = f.tell()
        f.seek(start)
        f.write(final)
        f.seek(end)


def prepare_named_safetensors(
    source: Source, *, order: Sequence[str], header: Mapping[str, Any] | None = None
) -> NamedWrite:
    """Plan ``source`` (any planning source) as a named safetensors file; nothing is read or written. ``order``:
    every parameter name, in the order that numbers ids; ``header``: the full dict's ``"fsdp_optim"`` block to keep
    (default: made from the source, as ``consolidate`` makes it). Refuses (``ValueError``/``TypeError``) what the
    plan refuses, per-rank state (MoE experts: no single name), a dtype safetensors cannot name, a value exact JSON
    cannot hold, or two state entries with one tensor name.
    """
    rank = {name: i for i, name in enumerate(order)}
    target = per_parameter(source, order)
    missing = [f.params[0].name for f in target.flat_params if f.params[0].name not in rank]
    if missing:
        raise ValueError(f"order: parameter '{missing[0]}' of {source.label} is not in the given order")
    the_plan = plan(source, target, order=[rank[f.params[0].name] for f in target.flat_params])
    prepared = NamedWrite(*_document(the_plan, order, header))
    prepared.header(None)  # encodes: refuses early
    return prepared


def _document(
    the_plan: Plan, order: Sequence[str], header: Mapping[str, Any] | None
) -> tuple[Document, tuple[Tensor, ...]]:
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
    items: list[Tensor] = []
    taken: dict[str, str] = {}
    scalar_keys: set[str] = set()
    for t in sorted(the_plan.flats, key=lambda t: rank[names[t]]):
        name, shape = names[t], flats[t].params[0].shape
        entries = []
        for e in the_plan.flats[t].entries:
            tname = f"{name}/{e.key}"
            if e.kind is StateKind.SHARDED:
                dtype = dtype_from_str(e.dtype, where=f"state '{e.key}' of parameter '{name}'")  # type: ignore[arg-type]
                make = partial(_assemble, the_plan, t, e.key, shape)
                items.append(Tensor(tname, shape, check_portable(tname, dtype), make))
            elif torch.is_tensor(e.value):
                scalar_keys.add(e.key)
                items.append(Tensor(tname, (), check_portable(tname, e.value.dtype), partial(clone_value, e.value)))
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
    return Document(source.optimizer, tuple(order), shapes, source.shapes_known, groups, state, header), tuple(items)


def _assemble(the_plan: Plan, t: int, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    return assemble_full(restrict(the_plan, t, key))[t][key].view(shape)
