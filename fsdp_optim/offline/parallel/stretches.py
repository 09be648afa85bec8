"""A process's share of a re-cut's output rank files (:class:`~fsdp_optim.core.split.StreamSplit`): each stretch of
a file's data turned into runs of whole chunks of one tensor (:class:`ChunkRun`), each run made of pieces of the
output rank's padded shards (:class:`ShardPiece`), each piece cut from the plan reading only its own source elements.

A rank file's tensor is its shards back to back (:func:`~fsdp_optim.formats.sharded.segments.file_layout`), so a
stretch of its bytes is a run of elements of each tensor it crosses, and those elements are the tail of one shard,
whole shards, the head of another::

    float32 of output rank 1: [u0/exp_avg 0..500 | u0/exp_avg_sq 500..1000 | u1/exp_avg 1000..1300]
    a stretch of elements 384..1024 -> u0/exp_avg [384, 500), u0/exp_avg_sq [0, 500), u1/exp_avg [0, 24)

A piece is at most :data:`PIECE_BYTES` (one is in memory at a time). Pure but for :func:`cut_piece`'s reads.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.intervals import overlapping
from fsdp_optim.core.source import Plan, Reader
from fsdp_optim.core.split import Stretch

__all__ = ["PIECE_BYTES", "ChunkRun", "ShardPiece", "chunk_runs", "cut_piece", "piece_reads"]

PIECE_BYTES = 64 << 20

FileLayout = tuple[Mapping[tuple[int, str], tuple[str, int, int]], Mapping[str, int]]  # segments.file_layout's


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[lo, hi)`` of the output rank's padded shard of state ``key`` of target flat ``flat``."""

    flat: int
    key: str
    lo: int
    hi: int


@dataclass(frozen=True)
class ChunkRun:
    """Elements ``[start, stop)`` of tensor number ``tensor`` (``name``) of output rank ``rank``'s file: whole
    chunks (or up to the tensor's end), made of ``pieces`` in order."""

    rank: int
    tensor: int
    name: str
    start: int
    stop: int
    pieces: tuple[ShardPiece, ...]

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * dtype_from_str(self.name, where="state").itemsize


def chunk_runs(layout: FileLayout, stretches: Sequence[Stretch]) -> list[ChunkRun]:
    """The runs of ``stretches`` (data bytes of output files, cut on chunk boundaries) in a file of ``layout``."""
    where, sizes = layout
    shards: dict[str, list[tuple[int, int, int, str]]] = {name: [] for name in sizes}
    for (flat, key), (tensor, offset, numel) in where.items():
        shards[tensor].append((offset, numel, flat, key))
    for found in shards.values():
        found.sort()
    runs = []
    for s in stretches:
        base = 0
        for k, (name, numel) in enumerate(sizes.items()):
            item = dtype_from_str(name, where="state").itemsize
            lo, hi = max(s.start, base), min(s.stop, base + numel * item)
            if lo < hi:
                start, stop = (lo - base) // item, (hi - base) // item
                runs.append(ChunkRun(s.output, k, name, start, stop, tuple(_pieces(shards[name], start, stop, item))))
            base += numel * item
    return runs


def _pieces(shards: Sequence[tuple[int, int, int, str]], start: int, stop: int, item: int) -> Iterator[ShardPiece]:
    """Pieces of the shards (``(offset, numel, flat, key)``, sorted) covering elements ``[start, stop)``."""
    most = max(1, PIECE_BYTES // item)
    k = max(bisect_right(shards, (start, float("inf"))) - 1, 0)
    while k < len(shards) and shards[k][0] < stop:
        offset, numel, flat, key = shards[k]
        lo, hi = max(start, offset) - offset, min(stop, offset + numel) - offset
        for at in range(lo, hi, most):
            yield ShardPiece(flat, key, at, min(at + most, hi))
        k += 1


def piece_reads(the_plan: Plan, rank: int, piece: ShardPiece) -> Iterator[tuple[int, int, int, int]]:
    """``(source flat, offset in the piece, source start, source stop)`` of every read that makes ``piece`` of
    output rank ``rank`` (full, unpadded source offsets); the padding past the rank's real elements reads nothing."""
    start, stop, _ = the_plan.shards.bounds(piece.flat, rank)
    a, b = start + piece.lo, start + min(piece.hi, stop - start)
    segments = the_plan.flats[piece.flat].segments
    for i in overlapping(segments, a, b):
        seg = segments[i]
        x, y = max(seg.start, a), min(seg.stop, b)
        if x < y:
            yield seg.source, x - a, seg.source_start + x - seg.start, seg.source_start + y - seg.start


def cut_piece(the_plan: Plan, rank: int, piece: ShardPiece, dtype: torch.dtype, read: Reader) -> torch.Tensor:
    """``piece`` of output rank ``rank``, new memory: its real elements read through ``read``, its padding zeros."""
    start, stop, _ = the_plan.shards.bounds(piece.flat, rank)
    real = min(max(stop - start - piece.lo, 0), piece.hi - piece.lo)
    out = torch.empty(piece.hi - piece.lo, dtype=dtype)
    out[real:].zero_()  # the padding; the reads fill every real element once (segments tile the flat)
    for source, at, first, last in piece_reads(the_plan, rank, piece):
        read(source, piece.key, first, last, out[at : at + last - first])
    return out
