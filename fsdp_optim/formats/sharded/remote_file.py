"""A rank file in an object store, read by ranged GETs of the chunks a read touches, each chunk verified first.

The same reads as :class:`~fsdp_optim.formats.sharded.mapped.MappedFile` (which maps a local file) with nothing
mapped: :meth:`RemoteFile.view` of elements ``[a, b)`` fetches the chunks of the checksum grid that ``[a, b)``
touches in one request, checks each against the manifest's digest and returns the part asked for, so a rank re-cut
from another world size fetches what it uses plus at most one chunk (64 KiB) on each side of each range.
"""

from __future__ import annotations

import torch

from fsdp_optim.disk.location import Location
from fsdp_optim.formats.sharded.mapped import MappedFile, check_buffer, verify
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.formats.sharded.segments import Grid, Placement, chunk_digests, chunk_elements

__all__ = ["RemoteFile"]


class RemoteFile(MappedFile):
    """Rank file ``name`` of ``store``: its header read (two ranged GETs) and checked; reads fetch ranges."""

    def __init__(self, store: Location, name: str, size: int) -> None:  # noqa: D107 - MappedFile's contract
        self.path = store / name  # type: ignore[assignment]  # shown as its URL
        self.store = store
        self.name = name
        pread = lambda count, offset: bytes(store.read_range(name, offset, offset + count))  # noqa: E731
        self.header = read_rank_header(pread, size, str(self.path))
        self._map = None
        self.size = size
        self._verified: set[tuple[str, int, int]] = set()
        self.bytes_verified = 0
        self.bytes_fetched = 0
        self._kept: tuple[tuple[str, int, int], torch.Tensor] | None = None  # (tensor, grid origin, chunk), its data

    def view(self, p: Placement, start: int, stop: int, chunk_bytes: int, where: str) -> torch.Tensor:
        """Elements ``[start, stop)`` of shard ``p`` in new memory, every chunk they touch fetched and verified.

        The last chunk fetched is kept (verified): a re-cut reads ranges in file order, and the next range often
        starts in the chunk where this one ended, which is then not fetched again."""
        dtype, base = self._dtype(p.tensor, where)
        if stop <= start:
            return torch.empty(0, dtype=dtype)
        g, per = p.grid, chunk_elements(dtype, chunk_bytes)
        first, last = (p.offset + start - g.origin) // per, -(-(p.offset + stop - g.origin) // per)
        lo, hi = g.origin + first * per, min(g.origin + last * per, g.end)
        kept = self._kept[1] if self._kept is not None and self._kept[0] == (g.tensor, g.origin, first) else None
        fetch_lo = lo + (kept.numel() if kept is not None else 0)
        fetched = self._fetch(base + fetch_lo * dtype.itemsize, hi - fetch_lo, dtype)
        found = chunk_digests(fetched, chunk_bytes) if fetched.numel() else ()
        verify(found, g, first + (kept is not None), lambda k: self._mismatch(p, g, k, per, where))
        self.bytes_verified += fetched.numel() * dtype.itemsize
        chunks = fetched if kept is None else torch.cat([kept, fetched]) if fetched.numel() else kept
        if fetched.numel():  # keep the last chunk fetched (whole: it ends at a chunk boundary or the grid's end)
            tail = (last - 1) * per + g.origin
            self._kept = ((g.tensor, g.origin, last - 1), chunks[tail - lo :].clone())
        return chunks[p.offset + start - lo : p.offset + stop - lo]

    def _read_tiled(
        self, g: Grid, parts: list[tuple[int, int]], dtype: torch.dtype, base: int, where: str  # noqa: ARG002 - MappedFile's arguments
    ) -> list[torch.Tensor]:
        """The whole tensor fetched at once (large ranges in concurrent pieces), each piece copied straight into
        the parts it covers (each part memory of its own)."""
        out = [torch.empty(n, dtype=dtype) for _, n in parts]
        buffers = [t.view(torch.uint8).numpy().data for t in out if t.numel()]
        self.store.read_into(self.name, base + g.origin * dtype.itemsize, buffers)
        nbytes = (g.end - g.origin) * dtype.itemsize
        self.bytes_fetched += nbytes
        self.bytes_verified += nbytes
        return out

    def _pread(
        self, start: int, count: int, dtype: torch.dtype, where: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_buffer(out, start, count, dtype, where)
        data = self._fetch(start, count, dtype)
        self.bytes_verified += count * dtype.itemsize
        if out is None:
            return data
        out.copy_(data)
        return out

    def _fetch(self, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = count * dtype.itemsize
        if count == 0:
            return torch.empty(0, dtype=dtype)
        got = self.store.read_range(self.name, start, start + nbytes)
        data = got if isinstance(got, bytearray) else bytearray(got)
        self.bytes_fetched += nbytes
        return torch.frombuffer(data, dtype=dtype, count=count)

    def drop_pages(self) -> None:
        self._verified.clear()  # (the kept chunk stays: 64 KiB, and the next unit's range may start in it)

    def close(self) -> None:
        self._verified.clear()
        self._kept = None
