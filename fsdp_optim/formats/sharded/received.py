"""A rank file of which some byte ranges are held in memory (received from a peer), read like a mapped file.

:class:`ReceivedFile` holds pieces ``[start, stop)`` of a file's bytes (its header, and the chunk-aligned ranges a
load reads) and serves :class:`~fsdp_optim.formats.sharded.mapped.MappedFile`'s reads from them: the same header
parsing, the same chunk verification before any byte is handed out, so a byte received is used only once its
64 KiB chunk matched the checksum in a header whose digest matched the manifest. Nothing is written to a file: the
pieces live as long as the reader, so no byte received can be read later without that check. A read outside the
pieces is refused (``ValueError``): the file's header places its tensors elsewhere than its manifest says.

A piece may still be arriving: its ``ready()`` is called (once) before its first use, so a load reads the pieces
in the order it needs them while later ones are still in flight. A piece may also count the shard reads it serves
(:class:`~fsdp_optim.disk.prefetch.StorePiece`): each :meth:`ReceivedFile.view` tells the piece it
read from (``used()``), and one whose bytes were dropped after its last read and are needed again is fetched
again, its chunks then verified again.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from fsdp_optim.formats.sharded.mapped import MappedFile
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.formats.sharded.segments import Placement, chunk_elements

__all__ = ["Held", "ReceivedPiece", "ReceivedFile", "held_readers"]


class Held(Protocol):
    """What :class:`ReceivedFile` reads: bytes ``[start, stop)`` of a file."""

    start: int

    @property
    def stop(self) -> int: ...

    @property
    def dropped(self) -> bool:
        """Whether its bytes were let go (the next :meth:`bytes` fetches them again)."""
        ...

    def bytes(self) -> torch.Tensor:
        """Its bytes (1-D uint8), once they are all there."""
        ...

    def used(self) -> None:
        """One shard read from it is done."""
        ...


@dataclass
class ReceivedPiece:
    """Bytes ``[start, start + data.numel())`` of a file, in ``data`` (1-D uint8) once ``ready()`` returned."""

    start: int
    data: torch.Tensor
    ready: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def stop(self) -> int:
        return self.start + self.data.numel()

    @property
    def dropped(self) -> bool:
        return False  # held as long as the reader

    def bytes(self) -> torch.Tensor:
        if self.ready is not None:
            ready, self.ready = self.ready, None
            ready()
        return self.data

    def used(self) -> None:
        pass


class ReceivedFile(MappedFile):
    """Rank file ``path`` (``size`` bytes) of which ``pieces`` are held (sorted, not overlapping; the header's bytes
    among them): its header read from them and checked; views and reads of the pieces, chunks verified first."""

    def __init__(self, path: Path, size: int, pieces: Sequence[Held]) -> None:  # noqa: D107 - see the class
        self.path = path
        self.size = size
        self._pieces = sorted(pieces, key=lambda p: p.start)
        self._starts = [p.start for p in self._pieces]
        self._map = None
        self._verified: set[tuple[str, int, int]] = set()
        self.bytes_verified = 0
        self.header = read_rank_header(lambda count, offset: self._bytes(offset, count).numpy().tobytes(), size,
                                       str(path))  # fmt: skip

    def view(self, p: Placement, start: int, stop: int, chunk_bytes: int, where: str) -> torch.Tensor:
        """:meth:`MappedFile.view`; the piece read from is told (``used()``), and chunks verified before are
        verified again when that piece's bytes were dropped (they will be fetched again)."""
        piece = self._piece_of(p, start, stop, chunk_bytes, where) if stop > start else None
        if piece is not None and piece.dropped:
            self._verified.clear()
        out = super().view(p, start, stop, chunk_bytes, where)
        if piece is not None:
            piece.used()
        return out

    def _piece_of(self, p: Placement, start: int, stop: int, chunk_bytes: int, where: str) -> Held | None:
        """The piece holding the chunks that elements ``[start, stop)`` of shard ``p`` touch (None: no one piece)."""
        dtype, base = self._dtype(p.tensor, where)
        g, per = p.grid, chunk_elements(dtype, chunk_bytes)
        lo = base + (g.origin + (p.offset + start - g.origin) // per * per) * dtype.itemsize
        hi = base + min(g.origin - (-(p.offset + stop - g.origin) // per) * per, g.end) * dtype.itemsize
        k = bisect.bisect_right(self._starts, lo) - 1
        return self._pieces[k] if k >= 0 and self._pieces[k].stop >= hi else None

    def _bytes(self, start: int, count: int) -> torch.Tensor:
        """Bytes ``[start, start + count)`` as a view of the piece holding them all."""
        k = bisect.bisect_right(self._starts, start) - 1
        if k < 0 or self._pieces[k].stop < start + count:
            held = [(p.start, p.stop) for p in self._pieces[max(k, 0) : k + 2]]
            raise ValueError(
                f"{self.path}: bytes {start}..{start + count} were not received (pieces near them: {held}); the "
                "file's header places its tensors elsewhere than its manifest says"
            )
        piece = self._pieces[k]
        return piece.bytes()[start - piece.start : start - piece.start + count]

    def _elements(self, base: int, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return self._bytes(base + offset * dtype.itemsize, count * dtype.itemsize).view(dtype)

    def _fill(self, raw: torch.Tensor, start: int, where: str) -> None:  # noqa: ARG002 - MappedFile's arguments
        raw.copy_(self._bytes(start, raw.numel()))

    def drop_pages(self) -> None:
        self._verified.clear()  # nothing mapped: the pieces stay, and are verified again when read again


def held_readers(
    records: Iterable[Any], shown: Callable[[str], Any], held: Mapping[str, Sequence[Held]]
) -> tuple[dict[int, Callable[[], ReceivedFile]], dict[str, Callable[[], bytes]]]:
    """The pieces ``held`` of a checkpoint's files (by name: fetched ahead from a store, or received from peers) as
    the readers its load uses in place of the files: ``{saved rank: opener of its ReceivedFile}`` for the rank
    files among ``records`` (the manifest's), ``{name: thunk of its bytes}`` for the others (side files, checked
    against the manifest's digest by their reader). ``shown(name)``: the file as error messages name it."""
    ranks = {r.file: r for r in records}
    files: dict[int, Callable[[], ReceivedFile]] = {
        ranks[name].rank: partial(ReceivedFile, shown(name), ranks[name].nbytes, pieces)
        for name, pieces in held.items()
        if name in ranks
    }
    sides: dict[str, Callable[[], bytes]] = {
        name: partial(_whole, pieces) for name, pieces in held.items() if name not in ranks
    }
    return files, sides


def _whole(pieces: Sequence[Held]) -> bytes:
    """A file's bytes from its pieces, in order (a side file: one piece from offset 0; anything else is refused by
    its size check)."""
    return b"".join(p.bytes().numpy().tobytes() for p in sorted(pieces, key=lambda p: p.start))
