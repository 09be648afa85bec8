"""A rank file mapped once, handing out zero-copy views of chunks it has verified.

Every byte handed out was hashed first, at the granularity of the chunk grid that guards it
(:class:`~fsdp_optim.formats.sharded.segments.Grid`): a view of elements ``[a, b)`` of a shard verifies the
chunks that ``[a, b)`` touches (once per mapping), so a range read hashes at most one chunk more on each
side than it copies. The mapping is private and read-only in use (``torch.frombuffer`` needs a writable
buffer; nothing writes to it).
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fsdp_optim.core.checksums import stream_chunk_digests
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.disk.untrusted import open_regular
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.formats.sharded.segments import Grid, Placement, chunk_digests, chunk_elements

__all__ = ["MappedFile", "check_grid", "check_tiling", "verify"]


class MappedFile:
    """A rank file mapped once; :meth:`view` returns verified zero-copy views of its shards."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd, st = open_regular(path, follow_symlinks=False)  # its name comes from the manifest
        try:
            self.header = read_rank_header(fd, st.st_size, str(path))
            # A private mapping: writable views for torch.frombuffer, never written to.
            self._map = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE) if st.st_size else None
        finally:
            os.close(fd)
        self.size = st.st_size
        self._verified: set[tuple[str, int, int]] = set()  # (tensor, grid origin, chunk)
        self.bytes_verified = 0  # bytes hashed so far: every byte read from the file is hashed once before use

    def _dtype(self, tensor: str, where: str) -> tuple[torch.dtype, int]:
        dtype_name, _, base = self.header.tensors[tensor]
        return dtype_from_str(dtype_name, where=where), base

    def view(self, p: Placement, start: int, stop: int, chunk_bytes: int, where: str) -> torch.Tensor:
        """Elements ``[start, stop)`` of shard ``p``, every chunk they touch verified against its checksum."""
        dtype, base = self._dtype(p.tensor, where)
        if stop <= start:
            return torch.empty(0, dtype=dtype)
        g, per = p.grid, chunk_elements(dtype, chunk_bytes)
        first, last = (p.offset + start - g.origin) // per, -(-(p.offset + stop - g.origin) // per)
        todo = [k for k in range(first, last) if (g.tensor, g.origin, k) not in self._verified]
        if todo:  # one pass over the unverified chunks (and any verified ones between them: rare, harmless)
            lo, hi = g.origin + todo[0] * per, min(g.origin + (todo[-1] + 1) * per, g.end)
            found = chunk_digests(self._elements(base, dtype, lo, hi - lo), chunk_bytes)
            verify(found, g, todo[0], lambda k: self._mismatch(p, g, k, per, where))
            self._verified.update((g.tensor, g.origin, k) for k in range(todo[0], todo[0] + len(found)))
            self.bytes_verified += (hi - lo) * dtype.itemsize
        return self._elements(base, dtype, p.offset + start, stop - start)

    @staticmethod
    def _mismatch(p: Placement, g: Grid, k: int, per: int, where: str) -> str:
        # A chunk may begin in the shard before this one and end in the next: the elements named are this shard's
        # own (0..numel), and the chunk's place in the file's buffer of its dtype (named by it) follows.
        lo, hi = g.origin + k * per, min(g.origin + (k + 1) * per, g.end)
        first, last = max(lo - p.offset, 0), min(hi - p.offset, p.numel)
        return (
            f"{where}: checksum mismatch in elements {first}..{last} of state '{p.key}' ({p.numel} elements; chunk "
            f"{k}, elements {lo}..{hi} of the rank file's {g.tensor} data; file is corrupt or was modified)"
        )

    def _elements(self, base: int, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        if count == 0 or self._map is None:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=base + offset * dtype.itemsize)

    def read(self, p: Placement, chunk_bytes: int, where: str) -> torch.Tensor:
        """Shard ``p`` read into new memory (not mapped) with the chunks around it, verified; a view of its part."""
        dtype, base = self._dtype(p.tensor, where)
        g, per = p.grid, chunk_elements(dtype, chunk_bytes)
        first, last = (p.offset - g.origin) // per, -(-(p.offset + p.numel - g.origin) // per)
        lo, hi = g.origin + first * per, min(g.origin + last * per, g.end)
        out = self._pread(base + lo * dtype.itemsize, max(hi - lo, 0), dtype, where)
        bad = f"{where}: checksum mismatch in state '{p.key}' (file is corrupt or was modified)"
        verify(chunk_digests(out, chunk_bytes), g, first, lambda _: bad)
        return out[p.offset - lo : p.offset - lo + p.numel]

    def read_tensor(
        self,
        g: Grid,
        chunk_bytes: int,
        where: str,
        out: torch.Tensor | None = None,
        holds: Callable[[int, int], str] | None = None,
    ) -> torch.Tensor:
        """A whole tensor that ``g`` covers read into new memory (or into ``out``, contiguous, of its size) and
        verified (format 3: one pread per dtype). ``holds(lo, hi)`` names what elements ``[lo, hi)`` belong to."""
        dtype, base = self._dtype(g.tensor, where)
        out = self._pread(base + g.origin * dtype.itemsize, g.end - g.origin, dtype, where, out)
        check_grid(chunk_digests(out, chunk_bytes), g, chunk_elements(dtype, chunk_bytes), where, holds)
        return out

    def read_parts(
        self,
        g: Grid,
        parts: list[tuple[int, int]],
        chunk_bytes: int,
        where: str,
        holds: Callable[[int, int], str] | None = None,
    ) -> list[torch.Tensor]:
        """The tensor that ``g`` covers read as separate tensors, ``parts`` (``(offset, numel)``, tiling it in
        order), each in memory of its own, all verified in one pass over the chunks (which may span parts).
        Memory of one shard each, as an optimizer holds it: freed and reused shard by shard, not all at once."""
        dtype, base = self._dtype(g.tensor, where)
        check_tiling(g, parts, where)
        out = self._read_tiled(g, parts, dtype, base, where)
        per = chunk_elements(dtype, chunk_bytes)
        check_grid(stream_chunk_digests(out, per, g.end - g.origin), g, per, where, holds)
        return out

    def read_chunks(self, g: Grid, lo: int, hi: int, out: torch.Tensor, chunk_bytes: int, where: str) -> None:
        """Elements ``[lo, hi)`` of the tensor ``g`` covers read into ``out`` (contiguous, ``hi - lo`` elements of its
        dtype: e.g. a staging slot), not verified yet (:meth:`check_chunks` does, on ``out``): ``lo`` starts a chunk
        and ``hi`` ends one (or the grid). Nothing is mapped."""
        dtype, base = self._dtype(g.tensor, where)
        per = chunk_elements(dtype, chunk_bytes)
        whole = (lo - g.origin) % per == 0 and (hi == g.end or (hi - g.origin) % per == 0)
        if not (g.origin <= lo <= hi <= g.end and whole):
            raise ValueError(
                f"{where}: elements {lo}..{hi} of tensor '{g.tensor}' are not whole chunks of its grid "
                f"({g.origin}..{g.end}, {per} elements a chunk)"
            )
        self._pread(base + lo * dtype.itemsize, hi - lo, dtype, where, out)

    @staticmethod
    def check_chunks(
        g: Grid, lo: int, values: torch.Tensor, chunk_bytes: int, where: str, holds: Callable[[int, int], str] | None
    ) -> None:
        """Refuse ``values`` (elements ``[lo, lo + len)`` of the tensor ``g`` covers, whole chunks, as
        :meth:`read_chunks` read them) unless each chunk's digest is ``g``'s; a mismatch names its elements."""
        per = chunk_elements(values.dtype, chunk_bytes)

        def bad(k: int) -> str:
            a, b = g.origin + k * per, min(g.origin + (k + 1) * per, g.end)
            return (f"{where}{holds(a, b) if holds else ''}: checksum mismatch in elements {a}..{b} of tensor "
                    f"'{g.tensor}' (file is corrupt or was modified)")  # fmt: skip

        verify(chunk_digests(values, chunk_bytes), g, (lo - g.origin) // per, bad)

    def _read_tiled(
        self, g: Grid, parts: list[tuple[int, int]], dtype: torch.dtype, base: int, where: str  # noqa: ARG002 - RemoteFile reads by g
    ) -> list[torch.Tensor]:
        """:meth:`read_parts`' reading, not verified yet: ``parts`` (tiling ``g``'s elements; ``base``: where its
        tensor's bytes start) each in new memory of its own; here one pread each."""
        return [self._pread(base + offset * dtype.itemsize, numel, dtype, where) for offset, numel in parts]

    def _pread(
        self, start: int, count: int, dtype: torch.dtype, where: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_buffer(out, start, count, dtype, where)
        if out is None:
            out = torch.empty(count, dtype=dtype)
        if count:
            self._fill(out.view(torch.uint8), start, where)
        self.bytes_verified += count * dtype.itemsize
        return out

    def _fill(self, raw: torch.Tensor, start: int, where: str) -> None:
        """Copy the file's bytes from ``start`` on into ``raw`` (bytes, contiguous); here by ``preadv``."""
        fd, _ = open_regular(self.path, follow_symlinks=False)
        try:
            into, at = raw.numpy(), 0
            while at < into.nbytes:
                got = os.preadv(fd, [into[at:]], start + at)  # type: ignore[list-item]
                if got <= 0:
                    raise ValueError(f"{where}: the file ended early (it changed while being read)")
                at += got
        finally:
            os.close(fd)

    def drop_pages(self) -> None:
        """Release the pages touched so far (and forget what was verified: they will be read again)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)
        self._verified.clear()

    def close(self) -> None:
        self._verified.clear()
        self._map = None  # unmapped once no view of it is left


def check_buffer(out: torch.Tensor | None, start: int, count: int, dtype: torch.dtype, where: str) -> None:
    """Refuse a buffer ``out`` given for the ``count`` ``dtype`` elements at byte ``start`` that cannot take them
    (its size, its dtype, not contiguous); ``None`` (new memory) passes."""
    if out is not None and (not out.is_contiguous() or out.numel() != count or out.dtype != dtype):
        raise ValueError(
            f"{where}: bytes {start}.. hold {count} {dtype} elements, but the buffer for them has {out.numel()} "
            f"{out.dtype} elements{'' if out.is_contiguous() else ', not contiguous'} (a manifest and rank file "
            "that disagree)"
        )


def check_tiling(g: Grid, parts: list[tuple[int, int]], where: str) -> None:
    """Refuse ``parts`` (``(offset, numel)``) that do not tile the elements ``g`` covers, in order."""
    starts = list(itertools.accumulate((n for _, n in parts[:-1]), initial=g.origin))
    if [o for o, _ in parts] != starts or (parts and parts[-1][0] + parts[-1][1] != g.end):
        raise ValueError(
            f"{where}: the shards of tensor '{g.tensor}' do not tile its elements {g.origin}..{g.end}: expected "
            f"shards starting at {starts[:8]}, found {[o for o, _ in parts][:8]} (a manifest and rank file "
            "that disagree)"
        )


def check_grid(
    found: tuple[str, ...], g: Grid, per: int, where: str, holds: Callable[[int, int], str] | None
) -> None:
    """Refuse the first chunk whose digest (``found``, the whole grid's) differs from ``g``'s, naming its elements
    and, through ``holds(lo, hi)``, what they belong to."""

    def bad(k: int) -> str:
        lo, hi = k * per, min((k + 1) * per, g.end)
        return (f"{where}{holds(lo, hi) if holds else ''}: checksum mismatch in elements {lo}..{hi} of the rank "
                f"file's {g.tensor} data (chunk {k}; file is corrupt or was modified)")  # fmt: skip

    verify(found, g, 0, bad)


def verify(found: Iterable[str], g: Grid, first: int, mismatch: Callable[[int], str]) -> None:
    """The one check of chunks read, whatever held their bytes (a mapping, a store's ranges, received pieces, a
    ring's slot): ``found`` are the digests of ``g``'s chunks ``first, first + 1, ...``; ``ValueError(mismatch(k))``
    for the first chunk ``k`` whose digest is not ``g``'s."""
    for k, (checksum, expected) in enumerate(zip(found, g.checksums[first:]), start=first):
        if checksum != expected:
            raise ValueError(mismatch(k))
