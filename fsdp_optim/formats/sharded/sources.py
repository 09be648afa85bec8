"""Where a rank file's bytes come from: the one thing that differs between the ways a rank file is read.

:class:`~fsdp_optim.formats.sharded.rank_file.RankFile` parses, checks and verifies; a :class:`ByteSource` only
hands it bytes. Three sources:

- :class:`MapSource`: a local file, mapped once (spans are zero-copy views of the mapping), filled by ``preadv``;
- :class:`StoreSource`: an object in a store, by ranged reads (each span is fetched; the last chunk it read is kept,
  since a re-cut reads ranges in file order and the next often starts in that chunk);
- :class:`HeldSource`: byte ranges held in memory (received from a peer, fetched ahead from a store); a read
  outside them is refused (``ValueError``: the file's header places its tensors elsewhere than its manifest says).

A span also says from which byte on its memory is new (not what the reader verified before): nothing for a mapping,
everything for a held piece that was dropped and fetched again, all but the kept chunk for a store.
"""

from __future__ import annotations

import bisect
import mmap
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from fsdp_optim.disk.location import Location
from fsdp_optim.disk.untrusted import open_regular

__all__ = ["ByteSource", "Held", "HeldSource", "MapSource", "ReceivedPiece", "StoreSource", "held_readers"]


class ByteSource(Protocol):
    """The bytes of one file of ``size`` bytes."""

    size: int

    def pread(self, count: int, offset: int) -> bytes: ...

    def fill(self, start: int, targets: Sequence[torch.Tensor]) -> None:
        """Copy the bytes from ``start`` on into ``targets`` (contiguous ``uint8`` tensors tiling them, in order)."""

    def span(self, start: int, stop: int, keep_from: int) -> tuple[torch.Tensor, int]:
        """Bytes ``[start, stop)`` to read in place (``uint8``), and the byte from which their memory is new
        (``stop``: none of it). ``keep_from``: where the last chunk of the span starts (a source may keep it)."""

    def drop(self) -> None:
        """Let the memory of what was read go (it is read again when needed)."""


class MapSource:
    """The local file ``path``, mapped once (private, read-only in use: ``torch.frombuffer`` wants a writable
    buffer; nothing writes to it)."""

    def __init__(self, path: Path) -> None:  # noqa: D107 - see the class
        self.path = path
        fd, st = open_regular(path, follow_symlinks=False)  # its name comes from a manifest
        try:
            self._map = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE) if st.st_size else None
        finally:
            os.close(fd)
        self.size = st.st_size

    def pread(self, count: int, offset: int) -> bytes:
        return self._map[offset : offset + count] if self._map is not None else b""

    def fill(self, start: int, targets: Sequence[torch.Tensor]) -> None:
        fd, _ = open_regular(self.path, follow_symlinks=False)
        try:
            for target in targets:
                into, at = target.numpy(), 0
                while at < into.nbytes:
                    got = os.preadv(fd, [into[at:]], start + at)  # type: ignore[list-item]
                    if got <= 0:
                        raise ValueError(f"{self.path}: the file ended early (it changed while being read)")
                    at += got
                start += into.nbytes
        finally:
            os.close(fd)

    def span(self, start: int, stop: int, keep_from: int) -> tuple[torch.Tensor, int]:  # noqa: ARG002
        if self._map is None or stop <= start:
            return torch.empty(0, dtype=torch.uint8), stop
        return torch.frombuffer(self._map, dtype=torch.uint8, count=stop - start, offset=start), stop

    def drop(self) -> None:
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)


class StoreSource:
    """Object ``name`` (``size`` bytes) of ``store``, read by ranged GETs."""

    def __init__(self, store: Location, name: str, size: int) -> None:  # noqa: D107 - see the class
        self.store, self.name, self.size = store, name, size
        self._kept: tuple[int, torch.Tensor] | None = None  # (first byte, bytes) of the last chunk a span read

    def pread(self, count: int, offset: int) -> bytes:
        return bytes(self.store.read_range(self.name, offset, offset + count))

    def fill(self, start: int, targets: Sequence[torch.Tensor]) -> None:
        self.store.read_into(self.name, start, [t.numpy().data for t in targets if t.numel()])

    def span(self, start: int, stop: int, keep_from: int) -> tuple[torch.Tensor, int]:
        kept = self._kept[1] if self._kept is not None and self._kept[0] == start else None
        fresh = start + (kept.numel() if kept is not None else 0)
        fetched = torch.empty(max(stop - fresh, 0), dtype=torch.uint8)
        self.fill(fresh, [fetched])
        if not fetched.numel():
            return (kept if kept is not None else fetched), stop
        data = fetched if kept is None else torch.cat([kept, fetched])
        self._kept = (keep_from, data[keep_from - start :].clone())
        return data, fresh

    def drop(self) -> None:
        pass  # (the kept chunk stays: one chunk, and the next range may start in it)


class Held(Protocol):
    """What :class:`HeldSource` reads: bytes ``[start, stop)`` of a file; ``bytes()`` (1-D uint8) once they are all
    there; ``dropped``: its bytes were let go (the next ``bytes()`` fetches them again); ``used()``: one shard read
    from it is done."""

    start: int

    @property
    def stop(self) -> int: ...

    @property
    def dropped(self) -> bool: ...

    def bytes(self) -> torch.Tensor: ...

    def used(self) -> None: ...


@dataclass
class ReceivedPiece:
    """Bytes ``[start, start + data.numel())`` of a file, in ``data`` (1-D uint8) once ``ready()`` returned (called
    once, before its first use: a load reads the pieces it needs while later ones are still in flight)."""

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


class HeldSource:
    """File ``path`` (``size`` bytes) of which ``pieces`` are held (not overlapping). A span is one shard read: it
    tells its piece (``used()``: a piece may let its bytes go after its last read, and fetch them again)."""

    def __init__(self, path: Path, size: int, pieces: Sequence[Held]) -> None:  # noqa: D107 - see the class
        self.path, self.size = path, size
        self._pieces = sorted(pieces, key=lambda p: p.start)
        self._starts = [p.start for p in self._pieces]

    def _piece(self, start: int, stop: int) -> Held:
        k = bisect.bisect_right(self._starts, start) - 1
        if k < 0 or self._pieces[k].stop < stop:
            held = [(p.start, p.stop) for p in self._pieces[max(k, 0) : k + 2]]
            raise ValueError(
                f"{self.path}: bytes {start}..{stop} were not received (pieces near them: {held}); the "
                "file's header places its tensors elsewhere than its manifest says"
            )
        return self._pieces[k]

    def pread(self, count: int, offset: int) -> bytes:
        piece = self._piece(offset, offset + count)
        return piece.bytes()[offset - piece.start : offset - piece.start + count].numpy().tobytes()

    def fill(self, start: int, targets: Sequence[torch.Tensor]) -> None:
        for target in targets:
            piece = self._piece(start, start + target.numel())
            target.copy_(piece.bytes()[start - piece.start : start - piece.start + target.numel()])
            start += target.numel()

    def span(self, start: int, stop: int, keep_from: int) -> tuple[torch.Tensor, int]:  # noqa: ARG002
        piece = self._piece(start, stop)
        fresh = start if piece.dropped else stop
        data = piece.bytes()[start - piece.start : stop - piece.start]
        piece.used()  # (a view of its bytes stays valid: the reader holds it)
        return data, fresh

    def drop(self) -> None:
        pass  # nothing mapped: the pieces stay


def held_readers(
    records: Iterable[Any], shown: Callable[[str], Any], held: Mapping[str, Sequence[Held]]
) -> tuple[dict[int, Callable[[], HeldSource]], dict[str, Callable[[], bytes]]]:
    """The pieces ``held`` of a checkpoint's files (by name: fetched ahead, or received from peers) as what its load
    reads in place of the files: ``{saved rank: opener of its HeldSource}`` for the rank files among ``records`` (the
    manifest's), ``{name: thunk of its bytes}`` for the others (side files). ``shown(name)``: the file in errors."""
    ranks = {r.file: r for r in records}
    files: dict[int, Callable[[], HeldSource]] = {
        ranks[name].rank: partial(HeldSource, shown(name), ranks[name].nbytes, pieces)
        for name, pieces in held.items()
        if name in ranks
    }
    sides: dict[str, Callable[[], bytes]] = {
        name: partial(_whole, pieces) for name, pieces in held.items() if name not in ranks
    }
    return files, sides


def _whole(pieces: Sequence[Held]) -> bytes:
    """A file's bytes from its pieces, in order (a side file: one piece from offset 0; else refused by its size)."""
    return b"".join(p.bytes().numpy().tobytes() for p in sorted(pieces, key=lambda p: p.start))
