"""Interval lookups on flat tensors cut like ``torch.chunk``: which ranks, which segments, which elements.

Pure arithmetic on a few ints per unit; no per-(unit, rank) record is ever built. A flat tensor of
``numel`` elements over ``world_size`` ranks is cut into chunks of ``c = ceil(numel / world_size)``:
rank ``r`` holds real elements ``[min(r*c, numel), min((r+1)*c, numel))``, so the ranks that overlap
``[start, stop)`` are ``start // c .. (stop - 1) // c`` and nothing needs to be scanned.

Worked example: ``numel = 10``, ``world_size = 4`` gives ``c = 3`` and real ranges ``[0,3) [3,6) [6,9) [9,10)``
(paddings ``0 0 0 2``). Elements ``[4, 10)`` live on ranks 1..3::

    list(ShardIndex((10,), (4,), (False,)).pieces(0, 4, 10)) == [(1, 4, 6), (2, 6, 9), (3, 9, 10)]  # (rank, lo, hi)

:class:`ShardIndex` keeps these ints for every unit of a layout in flat tuples (built once per reader or
plan), so a reader answers "which rank files does this range touch" in ``O(ranks touched)``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ShardIndex", "chunk", "overlapping", "padding_per_rank", "rank_range"]


def chunk(numel: int, world_size: int) -> int:
    """Elements in every rank's padded shard: ``ceil(numel / world_size)``."""
    return -(-numel // world_size)


def rank_range(numel: int, world_size: int, start: int, stop: int) -> range:
    """The ranks whose real elements overlap ``[start, stop)`` of a flat tensor of ``numel`` elements."""
    c = chunk(numel, world_size)
    if start >= stop or c == 0:
        return range(0)
    return range(start // c, min((stop - 1) // c + 1, world_size))


def padding_per_rank(numel: int, world_size: int) -> list[int]:
    """Padding elements of every rank's shard, without one record per rank: ``[0, ..., 0, tail, c, ..., c]``."""
    c = chunk(numel, world_size)
    if c == 0:
        return [0] * world_size
    full, rest = divmod(numel, c)
    tail = [c - rest] if rest else []
    return [0] * full + tail + [c] * (world_size - full - len(tail))


class _Interval(Protocol):
    @property
    def start(self) -> int: ...

    @property
    def stop(self) -> int: ...


def overlapping(intervals: Sequence[_Interval], start: int, stop: int) -> range:
    """Indices of the ``intervals`` (sorted, back to back, like a plan's segments) that overlap ``[start, stop)``."""
    if start >= stop or not intervals:
        return range(0)
    first = max(bisect_right(intervals, start, key=lambda s: s.start) - 1, 0)
    last = bisect_right(intervals, stop - 1, key=lambda s: s.start)
    return range(first, last)


@dataclass(frozen=True)
class ShardIndex:
    """Per unit of a layout, the ints its shard arithmetic needs: ``numel``, ``world_size``, ``per_rank``.

    Built once from the unit records (``ShardIndex.of(manifest.flat_params)``); then every question about
    a unit at a rank (:meth:`shard_numel`, :meth:`pieces`) is arithmetic on two ints.
    """

    numel: tuple[int, ...]
    world_size: tuple[int, ...]
    per_rank: tuple[bool, ...]

    @classmethod
    def of(cls, flats: Sequence[_Unit]) -> ShardIndex:
        return cls(
            tuple(f.numel for f in flats),
            tuple(f.world_size for f in flats),
            tuple(f.per_rank for f in flats),
        )

    def shard_numel(self, unit: int) -> int:
        """Elements of every rank's padded shard of ``unit`` (its whole numel when it is not sharded)."""
        return chunk(self.numel[unit], self.world_size[unit])

    def bounds(self, unit: int, rank: int) -> tuple[int, int, int]:
        """``(start, stop, padding)`` of ``rank``'s shard of ``unit`` (rank 0 for a unit that is not sharded)."""
        numel, c = self.numel[unit], self.shard_numel(unit)
        rank = rank if self.world_size[unit] > 1 else 0
        start = min(rank * c, numel)
        stop = min(start + c, numel)
        return start, stop, c - (stop - start)

    def pieces(self, unit: int, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(rank, lo, hi)`` for each saved rank holding part of ``[start, stop)`` of ``unit``: its part ``[lo, hi)``,
        global offsets, at ``[lo - rank * chunk, hi - rank * chunk)`` of its padded shard."""
        numel, world_size = self.numel[unit], self.world_size[unit]
        c = chunk(numel, world_size)
        for rank in rank_range(numel, world_size, start, stop):
            yield rank, max(start, rank * c), min(stop, (rank + 1) * c, numel)


class _Unit(Protocol):
    @property
    def numel(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def per_rank(self) -> bool: ...
