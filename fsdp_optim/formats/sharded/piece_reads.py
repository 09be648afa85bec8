"""A format-3 rank file read a piece at a time into a buffer of the caller's (a staging ring's slot), each piece's
chunk checksums checked on that buffer, with the shards each piece holds, so a loader copies them from the buffer
to where they go (a GPU's memory) and nothing the size of the file passes through pageable memory.

A piece is the whole checksum chunks of one tensor that fit the buffer: of tensor ``float32`` (``n`` elements, 64 KiB
chunks, a 32 MiB buffer), elements ``[0, 8Mi)``, ``[8Mi, 16Mi)``, ... ``[.., n)``. Shards tile each tensor in file
order and a piece may hold the end of one shard and the start of the next (:meth:`TensorPiece.spans`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.formats.sharded.rank_file import RankFile
from fsdp_optim.formats.sharded.segments import Placement, chunk_elements

__all__ = ["TensorPiece", "plan_pieces"]


@dataclass(frozen=True)
class TensorPiece:
    """Elements ``[lo, hi)`` of tensor ``tensor`` (whole chunks), and the shards that overlap them."""

    tensor: str
    dtype: torch.dtype
    lo: int
    hi: int
    shards: tuple[Placement, ...]

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.dtype.itemsize

    def spans(self) -> Iterator[tuple[Placement, int, int]]:
        """``(shard, a, b)``: elements ``[a, b)`` of ``shard`` lie in this piece, at element ``shard.offset + a -
        lo`` of it."""
        for s in self.shards:
            a, b = max(self.lo, s.offset) - s.offset, min(self.hi, s.offset + s.numel) - s.offset
            if b > a:
                yield s, a, b


def plan_pieces(rank_file: RankFile, piece_bytes: int) -> list[TensorPiece]:
    """Every piece of the format-3 ``rank_file`` (opened; its tensors in file order), each at most ``piece_bytes``
    long; ``ValueError`` when a checksum chunk does not fit in ``piece_bytes`` or the shards do not tile a tensor.
    A ring reads each into a slot (:meth:`RankFile.read_chunks`), checks it there (:meth:`RankFile.check_chunks`)."""
    where, header = str(rank_file.path), rank_file.open()
    if not rank_file.grids:
        raise ValueError(f"{where}: a format-{rank_file.manifest.version} rank file; pieces are read from format 3")
    out: list[TensorPiece] = []
    for g, shards in sorted(rank_file.grid_shards(), key=lambda gs: header.tensors[gs[0].tensor][2]):
        dtype = dtype_from_str(g.tensor, where=where)
        per = chunk_elements(dtype, rank_file.manifest.chunk_bytes)
        step = piece_bytes // dtype.itemsize // per * per
        if step == 0:
            raise ValueError(
                f"{where}: a buffer of {piece_bytes} bytes cannot hold one checksum chunk of tensor '{g.tensor}' "
                f"({per * dtype.itemsize} bytes)"
            )
        ends = [s.offset + s.numel for s in shards]
        for lo in range(g.origin, g.end, step):
            hi = min(lo + step, g.end)
            first = bisect.bisect_right(ends, lo)  # the first shard ending after lo
            last = bisect.bisect_left([s.offset for s in shards], hi)  # shards starting before hi
            out.append(TensorPiece(g.tensor, dtype, lo, hi, tuple(shards[first:last])))
    return out
