"""Rank files (formats 2 and 3): safetensors files, their header checked, read by byte range from any source.

A format-3 rank file (see :mod:`.segments` for where each shard lies in it; the container itself, its dtype names,
bounds and tiling, is :mod:`fsdp_optim.formats.safetensors_container`)::

    <u64 n> {"__metadata__": {"format": "fsdp_optim", "kind": "shard", "version": "3", "save_id": "3f2a...",
                              "rank": "0", "world_size": "2", "chunk_bytes": "65536",
                              "checksums": "{\"float32\": [\"xxh3-128:...\", ...]}"},    # JSON in a string
             "float32": {"dtype": "F32", "shape": [184], "data_offsets": [0, 736]}, ...}   <data>

one 1-D tensor per dtype, named by it; the manifest records the digest of the header (which covers the chunk
checksums) and the file's size. Any safetensors reader opens it. A format-2 file is the same without
``chunk_bytes`` and ``checksums`` (its manifest lists them per segment). The one writer is
:func:`~.ranged.write_rank`; this module reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from fsdp_optim.core.checksums import digest, stream_chunk_digests
from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.disk.json_input import RefusedJSON, loads
from fsdp_optim.disk.location import Location, ObjectPath
from fsdp_optim.disk.text import escape
from fsdp_optim.formats.safetensors_container import DTYPE_NAMES, HeaderError, HeaderRules, read_header
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.segments import (
    Grid,
    Placement,
    check_segments,
    chunk_digests,
    chunk_elements,
    grids_v3,
    shard_mismatch,
    verify_chunks,
)
from fsdp_optim.formats.sharded.sources import ByteSource, MapSource, StoreSource

__all__ = ["FileLayout", "Header", "Pieces", "RankFile", "host_pieces", "open_recorded", "read_rank_header"]

_WRITE_BYTES = 8 << 20  # bytes per write call
FileLayout = tuple[Mapping[tuple[int, str], tuple[str, int, int]], Mapping[str, int]]  # segments.file_layout's


def _rank_entry(at: str, name: str, dtype: str, shape: list[int]) -> None:
    """A rank file's tensor is named by its dtype and one-dimensional."""
    wanted = next((st for dt, st in DTYPE_NAMES.items() if dtype_to_str(dt) == name), None)
    if dtype != wanted:
        expected = repr(wanted) if wanted else "the dtype it is named by"
        raise HeaderError(f"{at}: dtype {escape(repr(dtype), limit=40)}, expected {expected}")
    if len(shape) != 1:
        raise HeaderError(f"{at}: shape {escape(repr(shape), limit=80)}, expected [n] (one non-negative int)")


# A rank file's header holds one entry per dtype and, in format 3, its chunk checksums (~48 bytes per 64 KiB
# chunk: 0.07 % of the data); bounded by 1 MiB + 1/256 of the file, and by safetensors' own 100 MB.
RANK_HEADER_RULES = HeaderRules(1 << 20, 256, "1 MiB + 1/256 of the file", _rank_entry)


@dataclass(frozen=True)
class Header:
    """A checked rank-file header: metadata, ``{name: (dtype name, numel, byte offset in the file)}``, digest."""

    metadata: Mapping[str, str]
    tensors: Mapping[str, tuple[str, int, int]]
    checksum: str


def read_rank_header(fd: int | Callable[[int, int], bytes], size: int, where: str) -> Header:
    """The checked header of the rank file open as ``fd`` (``size`` bytes long; or read by ``pread(count, offset)``):
    a ``ValueError`` naming the file, what was expected and what was found."""
    try:
        header = read_header(fd, size, where, RANK_HEADER_RULES)
    except HeaderError as exc:
        raise ValueError(str(exc)) from None  # what a rank file's readers refuse with
    tensors = {name: (name, span.shape[0], span.start) for name, span in header.tensors.items()}
    return Header(header.metadata, tensors, digest(header.text))


# pieces(parts): the bytes of the 1-D tensors parts, in order, as CPU uint8 tensors, each valid only until the next
# is asked for (a staging ring may reuse its memory); a job hands the writer its stager's (fsdp_optim.job.stager).
Pieces = Callable[[Sequence[torch.Tensor]], Iterator[torch.Tensor]]


def host_pieces(parts: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The bytes of ``parts`` without a copy, at most 8 MiB a piece (a tensor on a device is copied to the host
    first, whole: a job passes its stager instead)."""
    for part in parts:
        raw = part.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), _WRITE_BYTES):
            yield raw[start : start + _WRITE_BYTES]


class RankFile:
    """One rank file (format 2 or 3), opened on first use: the one reader of rank files, whatever holds their bytes
    (:mod:`.sources`). Every byte it hands out was hashed first, chunk by chunk of the grid that guards it, so a
    range read hashes at most one chunk more on each side than it copies. ``layout``: format 3's
    ``segments.file_layout``, once per checkpoint (format 2's manifest lists each file's segments). ``mapped``: the
    local directory holding ``directory``'s objects, mapped in place; ``None``: read by byte ranges."""

    def __init__(
        self, directory: Location, record: FileRecord, manifest: Manifest, layout: FileLayout, *, mapped: Path | None
    ) -> None:
        self.directory = directory
        self.mapped = mapped
        self.path: Path | ObjectPath = directory / record.file  # as messages name it
        self.record = record
        self.manifest = manifest
        self.layout = layout
        self.source: ByteSource | None = None
        self.provided: Callable[[], ByteSource] | None = None  # its bytes as the caller holds them instead
        self.header: Header | None = None
        self.grids: dict[str, Grid] = {}  # format 3: per tensor
        self.placements: dict[tuple[int, str], Placement] = {}  # format 2: per shard
        self._verified: set[tuple[str, int, int]] = set()  # (tensor, grid origin, chunk) verified in place
        self.bytes_verified = 0  # bytes hashed (or read to be hashed) so far

    def open(self) -> Header:
        """The file's checked header (its bytes' source opened and the header checked against the manifest once)."""
        if self.source is None or self.header is None:
            source, header = self._opened()
            self._check_header(header, source.size)
            self.source, self.header = source, header
        return self.header

    def _opened(self) -> tuple[ByteSource, Header]:
        if self.provided is not None:
            return _headed(self.provided(), self.path)
        if self.mapped is None:
            return _headed(_store_source(self.directory, self.record, self.path), self.path)
        path = self.mapped / self.record.file
        return open_recorded(path, self.record, lambda: _headed(MapSource(path), path),
                             partial(_truncated, self.path, self.record))  # fmt: skip

    def _check_header(self, header: Header, size: int) -> None:
        where, meta = str(self.path), header.metadata
        if meta.get("format") != "fsdp_optim" or meta.get("kind") != "shard":
            raise ValueError(
                f"{where}: expected an fsdp_optim rank file (metadata format 'fsdp_optim', kind 'shard'), found "
                f"format {escape(repr(meta.get('format')), limit=60)}, kind {escape(repr(meta.get('kind')), limit=60)}"
            )
        expected = {
            "version": str(self.manifest.version),
            "save_id": self.manifest.save_id,
            "rank": str(self.record.rank),
            "world_size": str(self.manifest.world_size),
        }
        if self.manifest.version >= 3:
            expected["chunk_bytes"] = str(self.manifest.chunk_bytes)
        for key, value in expected.items():
            if meta.get(key) != value:
                found = escape(repr(meta.get(key)), limit=80)
                raise ValueError(
                    f"{where}: {key} is {found}, expected {value!r} from the manifest (a file of another save?)"
                )
        if header.checksum != self.record.checksum:
            raise ValueError(
                f"{where}: header checksum {header.checksum} differs from the manifest's {self.record.checksum}"
            )
        if size != self.record.nbytes:
            raise ValueError(f"{where}: {size} bytes, but the manifest records {self.record.nbytes}")
        tensors = {name: numel for name, (_, numel, _) in header.tensors.items()}
        if self.manifest.version >= 3:
            checksums, chunk, units = _checksums(meta, where), self.manifest.chunk_bytes, self.manifest.flat_params
            self.grids = grids_v3(checksums, self.layout, tensors, chunk, where=where, units=units)
            return
        self.placements = check_segments(
            self.record.segments, tensors, self.manifest.flat_params, self.record.rank, self.manifest.chunk_bytes,
            where=where,
        )  # fmt: skip

    def where(self, flat_index: int) -> str:
        flat = self.manifest.flat_params[flat_index]
        return f"{self.path}, unit '{flat.unit or '<root>'}' (flat parameter {flat_index})"

    def placement(self, flat_index: int, key: str) -> Placement:
        """Where this file holds its shard of ``key`` of flat parameter ``flat_index`` (the file must be open)."""
        if not self.grids:
            return self.placements[(flat_index, key)]
        tensor, offset, numel = self.layout[0][(flat_index, key)]
        return Placement(flat_index, key, tensor, offset, numel, self.grids[tensor])

    def _dtype(self, tensor: str) -> tuple[torch.dtype, int, int]:
        """Tensor ``tensor``'s dtype, the byte its element 0 is at, and the elements of one checksum chunk."""
        assert self.header is not None, f"{self.path}: read before it was opened"
        dtype_name, _, base = self.header.tensors[tensor]
        dtype = dtype_from_str(dtype_name, where=str(self.path))
        return dtype, base, chunk_elements(dtype, self.manifest.chunk_bytes)

    def view(self, flat_index: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of this file's shard of ``key``, read in place (a mapped file: zero-copy),
        every chunk they touch verified against its checksum (once, while its memory holds what was verified)."""
        self.open()
        assert self.source is not None, f"{self.path}: not open"
        p, where = self.placement(flat_index, key), self.where(flat_index)
        (dtype, base, per), g = self._dtype(p.tensor), p.grid
        if stop <= start:
            return torch.empty(0, dtype=dtype)
        first, last = (p.offset + start - g.origin) // per, -(-(p.offset + stop - g.origin) // per)
        lo, hi, size = g.origin + first * per, min(g.origin + last * per, g.end), dtype.itemsize
        raw, fresh = self.source.span(base + lo * size, base + hi * size, base + (g.origin + (last - 1) * per) * size)
        new = first - (-(fresh - base - lo * size) // (per * size))  # the first chunk in memory not verified before
        if new < last:  # (what was verified elsewhere may no longer be what the memory holds)
            kept = {(g.tensor, g.origin, k) for k in range(first, new)}
            self._verified &= kept
        todo = [k for k in range(first, last) if k >= new or (g.tensor, g.origin, k) not in self._verified]
        values = raw.view(dtype)
        if todo:  # one pass over the unverified chunks (and any verified ones between them: rare, harmless)
            a, b = (todo[0] - first) * per, min((todo[-1] + 1 - first) * per, hi - lo)
            verify_chunks(chunk_digests(values[a:b], self.manifest.chunk_bytes), g, todo[0],
                   partial(shard_mismatch, p, per, where))  # fmt: skip
            self._verified.update((g.tensor, g.origin, k) for k in range(todo[0], todo[-1] + 1))
            self.bytes_verified += (b - a) * size
        return values[p.offset + start - lo : p.offset + stop - lo]

    def unit(self, flat_index: int) -> dict[str, Any]:
        """One unit's entries: its verified shards (read in place: copy what you keep) and the manifest's scalars."""
        out: dict[str, Any] = {}
        for e in self.manifest.flat_params[flat_index].state:
            if e.kind is not StateKind.SHARDED:
                out[e.key] = clone_value(e.value)  # the optimizer owns what it loads: never the manifest's record
            else:
                out[e.key] = self.view(flat_index, e.key, 0, self.placement(flat_index, e.key).numel)
        return out

    def load_all(self) -> dict[int, dict[str, Any]]:
        """Every unit's entries read into memory, each shard a tensor of its own (as the optimizer will hold them),
        each grid's shards verified in one pass over its chunks (format 3: a grid per dtype; 2: per shard)."""
        self.open()
        shards: dict[tuple[int, str], torch.Tensor] = {}
        for g, placed in self.grid_shards():  # each grid's shards in file order, read and verified as one pass
            parts = [torch.empty(p.numel, dtype=self._dtype(g.tensor)[0]) for p in placed]
            self._fill(g.tensor, g.origin, g.end, parts)
            self._verify(g, g.origin, parts)
            shards.update({(p.flat, p.key): tensor for p, tensor in zip(placed, parts)})
        out: dict[int, dict[str, Any]] = {}
        for i, flat in enumerate(self.manifest.flat_params):
            for e in flat.state:
                value = shards[(i, e.key)] if e.kind is StateKind.SHARDED else clone_value(e.value)
                out.setdefault(i, {})[e.key] = value
        return out

    def grid_shards(self) -> list[tuple[Grid, list[Placement]]]:
        """Each grid of the open file and the shards it covers, in file order: they tile it (format 3: the manifest's
        layout, whose sizes the header's tensors were checked against; format 2: a grid per shard)."""
        by_grid: dict[tuple[str, int], list[Placement]] = {}  # (tensor, origin): a grid's shards
        for p in sorted((self.placement(*k) for k in self._shards()), key=lambda p: p.offset):
            by_grid.setdefault((p.grid.tensor, p.grid.origin), []).append(p)
        for placed in by_grid.values():
            g, ends = placed[0].grid, list(itertools.accumulate((p.numel for p in placed), initial=placed[0].offset))
            if [p.offset for p in placed] != ends[:-1] or (ends[0], ends[-1]) != (g.origin, g.end):
                raise ValueError(f"{self.path}: the shards of '{g.tensor}' do not tile elements {g.origin}..{g.end}")
        return [(placed[0].grid, placed) for placed in by_grid.values()]

    def _shards(self) -> Mapping[tuple[int, str], tuple[str, int, int]]:
        """``{(flat, key): (tensor, offset, numel)}``: where this file holds each shard."""
        return self.layout[0] if self.grids else {k: (p.tensor, p.offset, p.numel) for k, p in self.placements.items()}

    def holds(self, tensor: str, lo: int, hi: int) -> str:
        """Which shards elements ``[lo, hi)`` of ``tensor`` belong to, for an error message."""
        hits = [(f, k) for (f, k), (t, at, n) in self._shards().items() if t == tensor and at < hi and at + n > lo]
        if not hits:
            return ""
        unit = self.manifest.flat_params[hits[0][0]].unit or "<root>"
        more = f" and {len(hits) - 1} more shards" if len(hits) > 1 else ""
        return f", unit '{unit}' state '{hits[0][1]}'{more}"

    def read_whole(self, tensor: str, out: torch.Tensor) -> None:
        """Format 3: tensor ``tensor`` read whole into ``out`` and verified; a mismatch names the units."""
        self.open()
        g = self.grids[tensor]
        self._fill(tensor, g.origin, g.end, [out])
        self._verify(g, g.origin, [out])

    def read_chunks(self, tensor: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Format 3: elements ``[lo, hi)`` (whole chunks) of ``tensor`` read into ``out`` (e.g. a staging slot),
        nothing mapped, not verified yet (:meth:`check_chunks` does, on ``out``)."""
        self.open()
        g, per = self.grids[tensor], self._dtype(tensor)[2]
        whole = (lo - g.origin) % per == 0 and (hi == g.end or (hi - g.origin) % per == 0)
        if not (g.origin <= lo <= hi <= g.end and whole):
            raise ValueError(
                f"{self.path}: elements {lo}..{hi} of tensor '{g.tensor}' are not whole chunks of its grid "
                f"({g.origin}..{g.end}, {per} elements a chunk)"
            )
        self._fill(tensor, lo, hi, [out])

    def check_chunks(self, tensor: str, lo: int, values: torch.Tensor) -> None:
        """Refuse ``values`` (elements ``[lo, lo + len)`` of ``tensor``, as :meth:`read_chunks` read them) unless
        each chunk's digest is the file's; a mismatch names the elements and the units they belong to."""
        self._verify(self.grids[tensor], lo, [values])

    def _fill(self, tensor: str, lo: int, hi: int, parts: Sequence[torch.Tensor]) -> None:
        """Elements ``[lo, hi)`` of ``tensor`` read into ``parts`` (contiguous, of its dtype, tiling them)."""
        dtype, base, _ = self._dtype(tensor)
        found = sum(p.numel() for p in parts)
        if found != hi - lo or any(p.dtype != dtype or not p.is_contiguous() for p in parts):
            raise ValueError(
                f"{self.path}: bytes {base + lo * dtype.itemsize}.. hold {hi - lo} {dtype} elements, but the "
                f"buffer for them has {found} {parts[0].dtype if parts else dtype} elements (contiguous: "
                f"{all(p.is_contiguous() for p in parts)}; a manifest and rank file that disagree)"
            )
        assert self.source is not None, f"{self.path}: not open"
        self.source.fill(base + lo * dtype.itemsize, [p.view(torch.uint8) for p in parts if p.numel()])
        self.bytes_verified += (hi - lo) * dtype.itemsize

    def _verify(self, g: Grid, lo: int, parts: Sequence[torch.Tensor]) -> None:
        """Refuse ``parts`` (elements from ``lo`` on, whole chunks of ``g``) unless each chunk's digest is ``g``'s,
        naming the elements and what they belong to."""
        per, total = self._dtype(g.tensor)[2], sum(p.numel() for p in parts)

        def bad(k: int) -> str:
            a, b = g.origin + k * per, min(g.origin + (k + 1) * per, g.end)
            return (f"{self.path}{self.holds(g.tensor, a, b)}: checksum mismatch in elements {a}..{b} of the rank "
                    f"file's {g.tensor} data (chunk {k}; file is corrupt or was modified)")  # fmt: skip

        verify_chunks(stream_chunk_digests(parts, per, total), g, (lo - g.origin) // per, bad)

    def drop(self) -> None:
        """Let go of the memory read so far (a mapping's pages); what was verified is verified again when read."""
        if self.source is not None:
            self.source.drop()
        self._verified.clear()

    def release(self) -> None:
        self.source, self.header = None, None  # (a mapping is unmapped once no view of it is left)
        self._verified.clear()


def _checksums(meta: Mapping[str, str], where: str) -> Any:
    """The chunk checksums a format-3 header holds: ``{tensor: [digest, ...]}`` (checked further by the caller)."""
    try:
        found = loads(meta.get("checksums", "null"), where=f"{where}: the header's 'checksums'")
    except RefusedJSON:
        raise
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: the header's 'checksums' is not JSON ({escape(str(exc), limit=120)})") from None
    if not isinstance(found, dict):
        raise ValueError(f"{where}: the header's 'checksums' must be an object by tensor, found {type(found).__name__}")
    return found


T = TypeVar("T")


def _store_source(directory: Location, record: FileRecord, path: Path | ObjectPath) -> StoreSource:
    """The rank file ``record`` names, read by ranges; errors as :func:`open_recorded`'s."""
    size = directory.size(record.file)
    if size is None:
        raise FileNotFoundError(
            f"{path}: no such object: the manifest lists it as rank {record.rank}'s file of {record.nbytes} bytes "
            "(the checkpoint is damaged; fsdp-optim verify checks every file)"
        )
    if size < record.nbytes:
        raise ValueError(_truncated(path, record, ValueError(f"{path}: {size} bytes"), size))
    return StoreSource(directory, record.file, size)


def _truncated(path: Path | ObjectPath, record: FileRecord, exc: ValueError, size: int) -> str:
    return (
        f"{path}: truncated: {size} of {record.nbytes} bytes (the size the manifest records; a copy or write that "
        f"did not finish?): {str(exc).removeprefix(f'{path}: ')}"
    )


def _headed(source: ByteSource, path: Path | ObjectPath) -> tuple[ByteSource, Header]:
    return source, read_rank_header(source.pread, source.size, str(path))


def open_recorded(
    path: Path, record: Any, open_file: Callable[[], T], truncated: Callable[[ValueError, int], str | None]
) -> T:
    """``open_file()`` for a rank file a manifest lists (``record``: its rank and size), its errors saying what the
    manifest knows: a missing file names its rank and size; a ``ValueError`` from a file smaller than recorded is
    re-raised as ``truncated(exc, size)`` (``None`` keeps the original refusal, which says what is wrong)."""
    try:
        return open_file()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no such file: the manifest lists it as rank {record.rank}'s file of {record.nbytes} "
            "bytes (the checkpoint is damaged; fsdp-optim verify checks every file)"
        ) from None
    except ValueError as exc:
        size = path.stat().st_size if path.is_file() else None
        message = None if size is None or size >= record.nbytes else truncated(exc, size)
        if message is None:
            raise
        raise ValueError(message) from None
