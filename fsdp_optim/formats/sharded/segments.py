"""Where each shard lies in a rank file, and the chunk checksums that guard it: records and pure checks.

A rank file (:mod:`.rank_file`) holds one 1-D tensor per dtype (named by it: ``"float32"``), the concatenation of
that rank's padded shards of that dtype. Format 3 records nothing per shard: the shards lie in every rank file in
the same order, ``(flat index, state key)`` sorted, each ``ceil(numel / world_size)`` elements long (a unit that
is not sharded: ``numel``), so offsets are prefix sums over the units, the same in every file (:func:`file_layout`).
The chunk checksums cut each *tensor* into chunks of ``chunk_bytes`` and live in the rank file's own header, which
the manifest's per-file digest covers::

    units 0 (exp_avg, exp_avg_sq: 3 elements each), 1 (exp_avg: 2 elements) ->
    "float32": [u0.exp_avg 0..3 | u0.exp_avg_sq 3..6 | u1.exp_avg 6..8]      # the same offsets in every rank file
    __metadata__["checksums"] = '{"float32": ["xxh3-128:...", ...]}'          # chunk k: elements [k*per, (k+1)*per)

Format 2 recorded, per rank file, one :class:`ShardSegment` per (unit, sharded state key) in the manifest, with
the checksums of that segment's own chunks (the manifest grew as ranks x units: 16.6 MiB at 256 x 256); it stays
readable::

    {"flat": 1, "key": "exp_avg", "tensor": "float32", "offset": 46, "numel": 46, "checksums": [...]}

Both come down to :class:`Placement`: a shard's place in its tensor and the :class:`Grid` of checksums that
covers it. A reader verifies every chunk it touches before it uses a byte of it.

Why one tensor per dtype and not one per (unit, key): a safetensors header grows ~70 bytes per tensor whatever its
size (``python -m benchmarks.format2 --layout``: 256 units of 16 KiB, header x 3.2 the payload against +0.7 %);
one tensor per dtype keeps a rank file within ``payload x 1.02 + 4 KiB``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.checksums import digests_of_chunks
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.records import FlatRecord, get_checked

__all__ = [
    "CHUNK_BYTES",
    "Grid",
    "Placement",
    "ShardSegment",
    "check_segments",
    "chunk_digests",
    "chunk_elements",
    "file_layout",
    "grids_v3",
    "manifest_shards",
    "plan_segments",
    "shard_mismatch",
    "verify_chunks",
]

# 64 KiB: a re-cut read of r bytes reads at most r + 128 KiB (<= 1.1 r from 1.25 MiB on: a third of a
# 1M-parameter unit's shard), at ~1.5x the hashing time of 256 KiB chunks (2.4 against 3.6 GB/s here);
# a 100M-parameter Adam state (800 MB) records ~12,800 checksums (~600 KiB of manifest).
CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class ShardSegment:
    """One shard of one state key in a rank file: ``numel`` elements at element ``offset`` of ``tensor``."""

    flat: int
    key: str
    tensor: str
    offset: int
    numel: int
    checksums: tuple[str, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def to_dict(self) -> dict[str, Any]:
        return {
            "flat": self.flat,
            "key": self.key,
            "tensor": self.tensor,
            "offset": self.offset,
            "numel": self.numel,
            "checksums": list(self.checksums),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> ShardSegment:
        ints = [get_checked(d, k, int, where) for k in ("flat", "offset", "numel")]
        if min(ints) < 0:
            raise ValueError(f"{where}: 'flat', 'offset' and 'numel' must be non-negative, found {ints}")
        checksums = get_checked(d, "checksums", (list, tuple), where)
        if not all(isinstance(c, str) for c in checksums):
            raise ValueError(f"{where}: 'checksums' must be strings, found {[type(c).__name__ for c in checksums][:3]}")
        key, tensor = get_checked(d, "key", str, where), get_checked(d, "tensor", str, where)
        return cls(ints[0], key, tensor, ints[1], ints[2], tuple(checksums))


def chunk_elements(dtype: torch.dtype, chunk_bytes: int) -> int:
    """Elements per checksum chunk of a ``dtype`` segment."""
    return max(1, chunk_bytes // dtype.itemsize)


def chunk_digests(values: torch.Tensor, chunk_bytes: int) -> tuple[str, ...]:
    """The chunk checksums of a 1-D segment (no copy): ``digest`` of each chunk's slice."""
    return digests_of_chunks(values, chunk_elements(values.dtype, chunk_bytes))


def plan_segments(
    state: Mapping[int, Mapping[str, Any]],
) -> tuple[dict[str, list[tuple[int, str, torch.Tensor]]], dict[str, int]]:
    """The tensors of a rank file: ``{dtype name: [(flat, key, 1-D shard), ...]}`` in file order (that of
    :func:`file_layout`) and each tensor's element count. Sharded state is every tensor of at least one
    dimension; 0-dim tensors and Python numbers are scalars, which the manifest holds."""
    tensors: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    for i in sorted(state):
        for key, value in sorted(state[i].items()):  # (flat, key) order: see file_layout
            if torch.is_tensor(value) and value.dim() >= 1:
                tensors.setdefault(str(value.dtype).removeprefix("torch."), []).append((i, key, value.reshape(-1)))
    return tensors, {name: sum(v.numel() for _, _, v in parts) for name, parts in tensors.items()}


@dataclass(frozen=True)
class Grid:
    """Chunk checksums over elements ``[origin, end)`` of tensor ``tensor``: chunk ``k`` covers
    ``[origin + k * per, min(origin + (k + 1) * per, end))``. Format 3: a whole tensor; format 2: one segment."""

    tensor: str
    origin: int
    end: int
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """Where one shard lies: ``numel`` elements at element ``offset`` of ``tensor``, guarded by ``grid``."""

    flat: int
    key: str
    tensor: str
    offset: int
    numel: int
    grid: Grid


Shard = tuple[int, str, str, int]  # (flat index, state key, dtype name, padded shard numel)


def file_layout(shards: Iterable[Shard]) -> tuple[dict[tuple[int, str], tuple[str, int, int]], dict[str, int]]:
    """Where format 3 puts each shard: ``{(flat, key): (tensor, offset, numel)}`` and ``{tensor: numel}``; the one
    rule writer and reader share: shards in ``(flat, key)`` order, each appended to the tensor of its dtype."""
    where: dict[tuple[int, str], tuple[str, int, int]] = {}
    sizes: dict[str, int] = {}
    for flat, key, tensor, numel in sorted(shards):
        at = sizes.get(tensor, 0)
        where[(flat, key)] = (tensor, at, numel)
        sizes[tensor] = at + numel
    return where, sizes


def manifest_shards(flat_params: Sequence[FlatRecord], shards: ShardIndex) -> list[Shard]:
    """The shards every rank file of a checkpoint holds, from its units: each sharded state key of each unit."""
    return [
        (i, e.key, str(e.dtype), shards.shard_numel(i))
        for i, flat in enumerate(flat_params)
        for e in flat.state
        if e.kind is StateKind.SHARDED
    ]


def grids_v3(
    checksums: Mapping[str, Any],
    layout: tuple[Mapping[tuple[int, str], tuple[str, int, int]], Mapping[str, int]],
    tensors: Mapping[str, int],
    chunk_bytes: int,
    *,
    where: str,
    units: Sequence[FlatRecord] = (),
) -> dict[str, Grid]:
    """The checked chunk grids of a format-3 rank file: its header's ``checksums`` (``{tensor: [digest, ...]}``)
    against the tensors the manifest's units put in it (``layout``, :func:`file_layout`'s) and those its header
    holds (``tensors``: ``{name: numel}``). ``units`` (the manifest's) names the units in errors."""
    sizes = layout[1]
    if dict(tensors) != dict(sizes):
        raise ValueError(
            f"{where}: holds tensors {dict(sorted(tensors.items()))} (name: elements), but the manifest's units "
            f"make {dict(sorted(sizes.items()))}{_largest(layout[0], tensors, units)}"
        )
    if set(checksums) != set(sizes):
        raise ValueError(f"{where}: chunk checksums for tensors {sorted(checksums)}, expected {sorted(sizes)}")
    grids = {}
    for name, numel in sizes.items():
        listed = checksums[name]
        per = chunk_elements(dtype_from_str(name, where=where), chunk_bytes)
        if not isinstance(listed, list) or not all(isinstance(c, str) for c in listed):
            raise ValueError(f"{where}: chunk checksums of '{name}' must be a list of strings")
        if len(listed) != -(-numel // per):
            raise ValueError(
                f"{where}: tensor '{name}' has {len(listed)} chunk checksums, expected {-(-numel // per)} "
                f"({numel} elements, {per} per chunk)"
            )
        grids[name] = Grid(name, 0, numel, tuple(listed))
    return grids


def _largest(
    where: Mapping[tuple[int, str], tuple[str, int, int]], tensors: Mapping[str, int], units: Sequence[FlatRecord]
) -> str:
    """Names the largest shard the manifest declares when it alone exceeds what the file holds."""
    if not where:
        return ""
    (flat, key), (tensor, _, numel) = max(where.items(), key=lambda item: item[1][2])
    if numel <= tensors.get(tensor, 0):
        return ""
    unit = units[flat].unit if flat < len(units) else str(flat)
    return f"; unit '{unit or '<root>'}' state '{key}' alone is declared {numel} elements per rank"


def check_segments(
    segments: Sequence[ShardSegment],
    tensors: Mapping[str, int],
    flat_params: Sequence[FlatRecord],
    rank: int,
    chunk_bytes: int,
    *,
    where: str,
) -> dict[tuple[int, str], Placement]:
    """Refuse segments that do not tile this rank file's ``tensors`` (``{name: numel}``, from its checked
    header) with exactly the shards the manifest's units say the file holds; return them by (flat, key), as
    placements each with a grid of its own."""
    by_key: dict[tuple[int, str], ShardSegment] = {}
    for s in segments:
        if (s.flat, s.key) in by_key:
            raise ValueError(f"{where}: segment of flat parameter {s.flat}, state '{s.key}' is listed twice")
        by_key[(s.flat, s.key)] = s
    expected = {
        (i, e.key): e
        for i, flat in enumerate(flat_params)
        for e in flat.state
        if e.kind is StateKind.SHARDED
    }
    if set(by_key) != set(expected):
        odd = sorted(set(by_key) ^ set(expected))[0]
        raise ValueError(
            f"{where}: the manifest's segments list {len(by_key)} shards, expected one per sharded state key of "
            f"every unit ({len(expected)}); e.g. flat parameter {odd[0]}, state '{odd[1]}' is "
            f"{'unexpected' if odd in by_key else 'missing'}"
        )
    for (i, key), s in by_key.items():
        flat, entry = flat_params[i], expected[(i, key)]
        numel = flat.layout(rank).shard_numel
        if s.tensor != entry.dtype or s.numel != numel:
            raise ValueError(
                f"{where}: segment of unit '{flat.unit or '<root>'}' state '{key}' is {s.numel} elements of "
                f"tensor {s.tensor!r}, expected {numel} elements of {entry.dtype!r}"
            )
        per = chunk_elements(dtype_from_str(s.tensor, where=where), chunk_bytes)
        if len(s.checksums) != -(-numel // per):
            raise ValueError(
                f"{where}: segment of unit '{flat.unit or '<root>'}' state '{key}' has {len(s.checksums)} chunk "
                f"checksums, expected {-(-numel // per)} ({numel} elements, {per} per chunk)"
            )
    _check_tiling(by_key.values(), tensors, where)
    return {
        k: Placement(s.flat, s.key, s.tensor, s.offset, s.numel, Grid(s.tensor, s.offset, s.end, s.checksums))
        for k, s in by_key.items()
    }


def _check_tiling(segments: Any, tensors: Mapping[str, int], where: str) -> None:
    """Each tensor must be covered exactly once, in order, by its segments (no overlap, no gap, in bounds)."""
    per_tensor: dict[str, list[ShardSegment]] = {}
    for s in segments:
        per_tensor.setdefault(s.tensor, []).append(s)
    if set(per_tensor) != set(tensors):
        raise ValueError(
            f"{where}: holds tensors {sorted(tensors)}, but the manifest's segments use "
            f"{sorted(per_tensor)}"
        )
    for name, parts in per_tensor.items():
        at = 0
        for s in sorted(parts, key=lambda s: s.offset):
            if s.offset != at:
                what = "overlaps the one before" if s.offset < at else f"leaves a gap after element {at}"
                raise ValueError(
                    f"{where}: segment of flat parameter {s.flat} state '{s.key}' at offset {s.offset} of "
                    f"'{name}' {what}"
                )
            at += s.numel
        if at != tensors[name]:
            raise ValueError(f"{where}: tensor '{name}' holds {tensors[name]} elements, but its segments cover {at}")


def shard_mismatch(p: Placement, per: int, where: str, k: int) -> str:
    """The refusal of chunk ``k`` of ``p``'s grid (``per`` elements a chunk) read for shard ``p``: a chunk may begin
    in the shard before this one and end in the next, so the elements named are this shard's own (0..numel), then
    the chunk's place in the file's buffer of its dtype (named by it)."""
    g = p.grid
    lo, hi = g.origin + k * per, min(g.origin + (k + 1) * per, g.end)
    first, last = max(lo - p.offset, 0), min(hi - p.offset, p.numel)
    return (
        f"{where}: checksum mismatch in elements {first}..{last} of state '{p.key}' ({p.numel} elements; chunk "
        f"{k}, elements {lo}..{hi} of the rank file's {g.tensor} data; file is corrupt or was modified)"
    )


def verify_chunks(found: Iterable[str], g: Grid, first: int, mismatch: Callable[[int], str]) -> None:
    """The one check of chunks read, whatever held their bytes (a mapping, a store's ranges, received pieces, a
    ring's slot): ``found`` are the digests of ``g``'s chunks ``first, first + 1, ...``; ``ValueError(mismatch(k))``
    for the first chunk ``k`` whose digest is not ``g``'s."""
    for k, (checksum, expected) in enumerate(zip(found, g.checksums[first:]), start=first):
        if checksum != expected:
            raise ValueError(mismatch(k))
