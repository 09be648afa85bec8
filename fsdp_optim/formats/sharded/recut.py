"""Re-cutting a format-3 checkpoint for another world size in whole blocks, not one copy per (unit, key, rank).

In format 3 every rank file lays its shards out alike (:func:`~.segments.file_layout`), so the rank files of
one dtype stack into a matrix ``rows[rank, element]`` in which each (unit, key) is a band of columns
``[offset, offset + c)``: the band read row after row *is* that unit's flat state, padded per rank. A group
of output ranks ``[a, b)`` is then built with one read per source file it overlaps and two copies per
(unit, key), whatever the world sizes::

    source W=4, c=3 (numel 10)        output W'=3, c'=4
    rows[:, off:off+3] = [[0 1 2]     flat = rows[:, off:off+3].reshape(-1)[:10] = 0..9
                          [3 4 5]     out[:, off':off'+4] = [[0 1 2 3]
                          [6 7 8]                            [4 5 6 7]
                          [9 . .]]                           [8 9 . .]]   (. = padding, zeros)

The cost is the bytes plus ``O(units)`` tensor operations per group, where cutting shard by shard costs
``O(units x output ranks)`` small copies (98,000 re-cutting 256 ranks of 256 units to 192). A group holds the
source rows it overlaps and its own output rows, at most ``budget`` bytes (:func:`group_size`; 0: the caller
cuts unit by unit).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.layout import FlatParamLayout
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.segments import file_layout, manifest_shards

__all__ = ["Recut", "applicable", "full_flats", "group_size", "recut_groups", "same_units"]

Where = Mapping[tuple[int, str], tuple[str, int, int]]  # (flat, key) -> (tensor, offset, numel)


@dataclass(frozen=True)
class Recut:
    """What a block re-cut needs of the source and the target: both file layouts and unit ints."""

    source: ShardIndex
    target: ShardIndex
    source_where: Where
    target_where: Where
    target_sizes: Mapping[str, int]
    world_size: int  # the source's
    new_world_size: int

    @classmethod
    def of(cls, ckpt: ShardedCheckpoint, target: Manifest) -> Recut:
        shards = ShardIndex.of(target.flat_params)
        where, sizes = file_layout(manifest_shards(target.flat_params, shards))
        return cls(ckpt.shards, shards, ckpt.layout[0], where, sizes, ckpt.manifest.world_size, target.world_size)

    def rank_bytes(self, sizes: Mapping[str, int]) -> int:
        return sum(n * dtype_from_str(name, where="state").itemsize for name, n in sizes.items())


def same_units(ckpt: ShardedCheckpoint, flats: Sequence[FlatParamLayout]) -> bool:
    """Whether ``flats`` are the checkpoint's own units (names and parameters, in order), whatever their world size."""
    return [(f.unit, f.params) for f in flats] == [(f.unit, f.params) for f in ckpt.manifest.flat_params]


def applicable(ckpt: ShardedCheckpoint, target: Manifest) -> bool:
    """Whether a block re-cut can write ``target`` from ``ckpt``: format 3, the same units with the same sharded
    state keys and dtypes, none per rank."""
    if ckpt.manifest.version < 3 or any(f.per_rank for f in target.flat_params):
        return False
    if not same_units(ckpt, target.flat_params):
        return False
    keys = [(i, k, t) for (i, k, t, _) in manifest_shards(target.flat_params, ShardIndex.of(target.flat_params))]
    return sorted(keys) == sorted((i, k, t) for (i, k), (t, _, _) in ckpt.layout[0].items())


def group_size(recut: Recut, source_sizes: Mapping[str, int], budget: int) -> int:
    """Output ranks per group such that a group's source rows and output rows fit in ``budget`` bytes (0: not
    even one output rank fits), judged on the first group (the others overlap as many source ranks, +- one)."""
    out_rank, in_rank = recut.rank_bytes(recut.target_sizes), recut.rank_bytes(source_sizes)
    g = recut.new_world_size
    while g >= 1:
        lo, hi = _source_ranks(recut, 0, g)
        if g * out_rank + (hi - lo + 1) * in_rank <= budget:
            return g
        g //= 2
    return 0


def _source_ranks(recut: Recut, a: int, b: int) -> tuple[int, int]:
    """The source ranks ``[lo, hi)`` whose files hold some element that output ranks ``[a, b)`` need."""
    lo, hi = recut.world_size, 0
    for flat, _ in recut.source_where:
        c = recut.source.shard_numel(flat)
        if recut.source.world_size[flat] == 1:
            lo, hi = 0, max(hi, 1)  # stored whole in every file: read it from the first
            continue
        start, stop = _needed(recut, flat, a, b)
        if start < stop:
            lo, hi = min(lo, start // c), max(hi, (stop - 1) // c + 1)
    return (lo, hi) if lo < hi else (0, 0)


def _needed(recut: Recut, flat: int, a: int, b: int) -> tuple[int, int]:
    """The real elements of unit ``flat`` that output ranks ``[a, b)`` hold."""
    numel, c = recut.target.numel[flat], recut.target.shard_numel(flat)
    if recut.target.world_size[flat] == 1:
        return 0, numel
    return min(a * c, numel), min(b * c, numel)


def recut_groups(ckpt: ShardedCheckpoint, recut: Recut, group: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """``(output rank, {tensor name: 1-D tensor})`` for every output rank in order, ``group`` ranks at a time."""
    for a in range(0, recut.new_world_size, group):
        b = min(a + group, recut.new_world_size)
        lo, hi = _source_ranks(recut, a, b)
        sizes = recut.target_sizes
        out = {name: torch.zeros(b - a, n, dtype=dtype_from_str(name, where="state")) for name, n in sizes.items()}
        for name, n in ckpt.layout[1].items():
            rows = torch.empty(hi - lo, n, dtype=dtype_from_str(name, where="state"))
            ckpt.read_rows(name, range(lo, hi), rows)
            _fill(recut, name, rows, lo, out[name], a, b)
            del rows
        for i in range(b - a):
            yield a + i, {name: t[i] for name, t in out.items()}
        del out


def _fill(recut: Recut, tensor: str, rows: torch.Tensor, lo: int, out: torch.Tensor, a: int, b: int) -> None:
    """Every (unit, key) band of ``tensor`` from the source ``rows`` (ranks ``lo``..) into ``out`` (``a``..``b``)."""
    for (flat, key), (name, offset, c) in recut.source_where.items():
        if name != tensor:
            continue
        numel = recut.source.numel[flat]
        if recut.source.world_size[flat] > 1:
            full, base = rows[:, offset : offset + c].reshape(-1), lo * c  # elements [base, base + rows * c)
        else:
            full, base = rows[0, offset : offset + numel], 0
        _, to, c2 = recut.target_where[(flat, key)]
        start, stop = _needed(recut, flat, a, b)
        if recut.target.world_size[flat] == 1:
            out[:, to : to + numel].copy_(full[start - base : stop - base].expand(b - a, numel))
            continue
        real = stop - start
        whole, rest = divmod(real, c2) if c2 else (0, 0)
        if whole:
            out[:whole, to : to + c2].copy_(full[start - base : start - base + whole * c2].view(whole, c2))
        if rest:
            out[whole, to : to + rest].copy_(full[start - base + whole * c2 : stop - base])


def full_flats(ckpt: ShardedCheckpoint, budget: int) -> dict[tuple[int, str], torch.Tensor] | None:
    """Every (unit, key)'s full flat state (padding dropped, new memory) of a format-3 checkpoint without per-rank
    units, read as whole rows: one read per rank file, one copy per (unit, key); ``None`` when that does not apply or
    the rows would exceed ``budget`` bytes."""
    manifest = ckpt.manifest
    if manifest.version < 3 or any(f.per_rank for f in manifest.flat_params):
        return None
    row_bytes = sum(n * dtype_from_str(name, where="state").itemsize for name, n in ckpt.layout[1].items())
    if row_bytes * manifest.world_size > budget:
        return None
    out: dict[tuple[int, str], torch.Tensor] = {}
    for name, n in ckpt.layout[1].items():
        rows = torch.empty(manifest.world_size, n, dtype=dtype_from_str(name, where="state"))
        ckpt.read_rows(name, range(manifest.world_size), rows)
        for (flat, key), (tensor, offset, c) in ckpt.layout[0].items():
            if tensor == name:
                out[(flat, key)] = _unpadded(rows, offset, c, ckpt.shards.numel[flat], ckpt.shards.world_size[flat])
        del rows
    return out


def _unpadded(rows: torch.Tensor, offset: int, c: int, numel: int, world_size: int) -> torch.Tensor:
    """The ``numel`` real elements of the band ``rows[:, offset : offset + c]`` read row after row (one copy)."""
    if world_size == 1:  # stored whole in every rank file
        return rows[0, offset : offset + numel].clone()
    full = torch.empty(numel, dtype=rows.dtype)
    whole, rest = divmod(numel, c) if c else (0, 0)
    if whole:
        full[: whole * c].view(whole, c).copy_(rows[:whole, offset : offset + c])
    if rest:
        full[whole * c :].copy_(rows[whole, offset : offset + rest])
    return full
