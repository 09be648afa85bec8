"""Format-2 rank files: safetensors files written as a stream, read by byte range through one checked mapping.

The file (the safetensors layout: an 8-byte little-endian header length, a JSON header, the data)::

    <u64 n> {"__metadata__": {"format": "fsdp_optim", "kind": "shard", "version": "2", "save_id": "3f2a...",
                              "rank": "0", "world_size": "2"},
             "float32": {"dtype": "F32", "shape": [184], "data_offsets": [0, 736]}, ...}   <data>

one 1-D tensor per dtype (see :mod:`.segments` for why, and for where each shard lies in it). Any
safetensors reader opens it (``safetensors.safe_open(path, framework="pt")``). We write it ourselves,
streaming each shard's bytes straight from the optimizer's tensors: ``safetensors.torch.save_file`` takes
a dict of whole tensors, which would cost a copy of the rank's state to concatenate them.

Reading never trusts the header: :func:`read_header` bounds its length by the file and
:data:`MAX_HEADER_BYTES` before reading it, and refuses unknown dtypes, shapes that are not one
non-negative int, offsets out of the data, overlapping or not tiling it, and byte counts that disagree
with the shapes, each as a ``ValueError`` naming the file, what was expected and what was found.
:class:`MappedFile` then maps the file once (private, read-only use) and hands out zero-copy views of
verified chunks.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch

from fsdp_optim.core.checksums import digest
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.disk.text import escape
from fsdp_optim.disk.untrusted import open_regular
from fsdp_optim.formats.sharded.manifest import FileRecord, Manifest
from fsdp_optim.formats.sharded.segments import Segment, check_segments, chunk_digests, chunk_elements, plan_segments

__all__ = [
    "MAX_HEADER_BYTES",
    "Header",
    "MappedFile",
    "RankFile",
    "describe_rank_file",
    "read_header",
    "write_rank_file",
]

MAX_HEADER_BYTES = 1 << 20  # ours holds one entry per dtype: a few hundred bytes
_WRITE_BYTES = 8 << 20  # bytes per write call
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint64": "U64", "uint32": "U32", "uint16": "U16",
}  # fmt: skip
_TORCH_NAMES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class Header:
    """A checked rank-file header: its metadata, ``{name: (dtype name, numel, byte offset in the file)}``, its
    digest."""

    metadata: Mapping[str, str]
    tensors: Mapping[str, tuple[str, int, int]]
    checksum: str


def write_rank_file(
    file: BinaryIO, state: Mapping[int, Mapping[str, Any]], metadata: Mapping[str, str], chunk_bytes: int
) -> tuple[str, tuple[Segment, ...]]:
    """Write a rank file of ``state`` (``{flat: {key: padded 1-D shard or scalar}}``; scalars are skipped) to
    ``file``; return its header's checksum and the segments the manifest records."""
    tensors, sizes = plan_segments(state)
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    segments, at = [], 0
    for name, parts in tensors.items():
        nbytes = sizes[name] * dtype_from_str(name, where="state").itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[name], "shape": [sizes[name]], "data_offsets": [at, at + nbytes]}
        at += nbytes
        offset = 0
        for flat, key, values in parts:
            segments.append(Segment(flat, key, name, offset, values.numel(), chunk_digests(values, chunk_bytes)))
            offset += values.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    file.write(struct.pack("<Q", len(text)) + text)
    for parts in tensors.values():
        for _, _, values in parts:
            raw = values.contiguous().view(torch.uint8)
            for start in range(0, raw.numel(), _WRITE_BYTES):
                file.write(memoryview(raw[start : start + _WRITE_BYTES].numpy()))  # type: ignore[arg-type]
    return digest(text), tuple(segments)


def read_header(fd: int, size: int, where: str) -> Header:
    """The checked header of the safetensors file open as ``fd`` (``size`` bytes long)."""
    if size < 8:
        raise ValueError(
            f"{where}: {size} bytes, too short for a safetensors file (expected an 8-byte header length "
            "first)"
        )
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(
            f"{where}: declares a {n}-byte header, expected at most {min(size - 8, MAX_HEADER_BYTES)} (the file has "
            f"{size} bytes; headers are bounded by {MAX_HEADER_BYTES})"
        )
    text = os.pread(fd, n, 8)
    try:
        header = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: the safetensors header is not JSON ({escape(str(exc), limit=200)})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ValueError(
            f"{where}: the safetensors header must be an object with an object '__metadata__', found "
            f"{type(header).__name__}"
        )
    metadata = header.pop("__metadata__", {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{where}: '__metadata__' values must be strings (the safetensors format)")
    data = size - 8 - n
    tensors = {name: _entry(name, e, data, where) for name, e in header.items()}
    _check_disjoint(header, data, where)
    offsets = {name: (dt, numel, 8 + n + start) for name, (dt, numel, start) in tensors.items()}
    return Header(metadata, offsets, digest(text))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _entry(name: str, e: Any, data: int, where: str) -> tuple[str, int, int]:
    """One tensor entry checked alone: ``(dtype name, numel, start byte in the data)``."""
    at = f"{where}: tensor '{escape(str(name), limit=80)}'"
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        found = escape(repr(sorted(e)), limit=120) if isinstance(e, dict) else type(e).__name__
        raise ValueError(f"{at}: expected an object with 'dtype', 'shape', 'data_offsets', found {found}")
    dtype = _TORCH_NAMES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None or dtype != name:
        raise ValueError(
            f"{at}: dtype {escape(repr(e['dtype']), limit=40)}, expected "
            f"{_SAFETENSORS_DTYPES.get(name, 'the dtype it is named by')!r}"
        )
    shape, offsets = e["shape"], e["data_offsets"]
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
        raise ValueError(f"{at}: shape {escape(repr(shape), limit=80)}, expected [n] (one non-negative int)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"{at}: data_offsets {escape(repr(offsets), limit=80)}, expected [begin, end] (two ints)")
    begin, end = offsets
    nbytes = shape[0] * dtype_from_str(dtype, where=at).itemsize
    if not 0 <= begin <= end <= data:
        raise ValueError(f"{at}: data_offsets [{begin}, {end}] lie outside the file's {data} bytes of data")
    if end - begin != nbytes:
        raise ValueError(
            f"{at}: data_offsets [{begin}, {end}] span {end - begin} bytes, expected {nbytes} for shape "
            f"{shape} {dtype}"
        )
    return dtype, shape[0], begin


def _check_disjoint(header: Mapping[str, Any], data: int, where: str) -> None:
    """The tensors must tile the data exactly (what safetensors itself requires): no overlap, no gap."""
    at = 0
    for begin, end, name in sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items()):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves bytes {at}..{begin} unused"
            raise ValueError(f"{where}: tensor '{escape(name, limit=80)}' at data_offsets [{begin}, {end}] {what}")
        at = end
    if at != data:
        raise ValueError(f"{where}: the tensors cover {at} bytes of data, but the file holds {data} after its header")


def describe_rank_file(path: Path) -> list[str]:
    """What ``fsdp-optim inspect`` prints about one format-2 rank file (its checked header only)."""
    fd, st = open_regular(path)
    try:
        header = read_header(fd, st.st_size, str(path))
    finally:
        os.close(fd)
    meta = header.metadata
    if meta.get("format") != "fsdp_optim" or meta.get("kind") != "shard":
        raise ValueError(
            f"{path}: a safetensors file, but not an fsdp_optim rank file (its metadata: "
            f"{escape(repr(dict(meta)), limit=200)})"
        )
    tensors = ", ".join(f"{name} [{numel}]" for name, (_, numel, _) in header.tensors.items()) or "-"
    return [
        f"format: one rank file of a sharded checkpoint (version {escape(meta.get('version', '?'), limit=20)}; "
        "inspect its directory for the whole)",
        f"rank: {escape(meta.get('rank', '?'), limit=20)} of {escape(meta.get('world_size', '?'), limit=20)}",
        f"tensors: {tensors}",
    ]


class MappedFile:
    """A rank file mapped once; :meth:`view` returns verified zero-copy views of its segments."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd, st = open_regular(path, follow_symlinks=False)  # its name comes from the manifest
        try:
            self.header = read_header(fd, st.st_size, str(path))
            # A private mapping: writable views for torch.frombuffer, never written to.
            self._map = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE) if st.st_size else None
        finally:
            os.close(fd)
        self.size = st.st_size
        self._verified: set[tuple[str, int, int]] = set()
        self.bytes_verified = 0  # bytes hashed so far: every byte read from the file is hashed once before use

    def view(self, s: Segment, start: int, stop: int, chunk_bytes: int, where: str) -> torch.Tensor:
        """Elements ``[start, stop)`` of segment ``s``, every chunk they touch verified against its checksum."""
        dtype_name, _, base = self.header.tensors[s.tensor]
        dtype = dtype_from_str(dtype_name, where=where)
        per = chunk_elements(dtype, chunk_bytes)
        todo = [k for k in range(start // per, -(-stop // per)) if (s.tensor, s.offset, k) not in self._verified]
        if todo:  # one pass over the unverified chunks (and any verified ones between them: rare, harmless)
            lo, hi = todo[0] * per, min((todo[-1] + 1) * per, s.numel)
            found = chunk_digests(self._elements(base, dtype, s.offset + lo, hi - lo), chunk_bytes)
            for k, checksum in enumerate(found, start=todo[0]):
                if checksum != s.checksums[k]:
                    raise ValueError(
                        f"{where}: checksum mismatch in elements {k * per}..{min((k + 1) * per, s.numel)} of state "
                        f"'{s.key}' (file is corrupt or was modified)"
                    )
                self._verified.add((s.tensor, s.offset, k))
            self.bytes_verified += (hi - lo) * dtype.itemsize
        return self._elements(base, dtype, s.offset + start, stop - start)

    def _elements(self, base: int, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        if count == 0 or self._map is None:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=base + offset * dtype.itemsize)

    def read(self, s: Segment, chunk_bytes: int, where: str) -> torch.Tensor:
        """Segment ``s`` read into a new tensor (not mapped), verified chunk by chunk."""
        dtype_name, _, base = self.header.tensors[s.tensor]
        dtype = dtype_from_str(dtype_name, where=where)
        out = torch.empty(s.numel, dtype=dtype)
        if s.numel:
            fd, _ = open_regular(self.path, follow_symlinks=False)
            try:
                raw, at, start = out.view(torch.uint8).numpy(), 0, base + s.offset * dtype.itemsize
                while at < raw.nbytes:
                    got = os.preadv(fd, [raw[at:]], start + at)  # type: ignore[list-item]
                    if got <= 0:
                        raise ValueError(f"{where}: the file ended early (it changed while being read)")
                    at += got
            finally:
                os.close(fd)
        self.bytes_verified += s.numel * dtype.itemsize
        if chunk_digests(out, chunk_bytes) != s.checksums:
            raise ValueError(f"{where}: checksum mismatch in state '{s.key}' (file is corrupt or was modified)")
        return out

    def drop_pages(self) -> None:
        """Release the pages touched so far (and forget what was verified: they will be read again)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)
        self._verified.clear()

    def close(self) -> None:
        self._verified.clear()
        self._map = None  # unmapped once no view of it is left


class RankFile:
    """One format-2 rank file of a checkpoint, opened (mapped, header checked against the manifest) on first use."""

    def __init__(self, directory: Path, record: FileRecord, manifest: Manifest) -> None:
        self.path = directory / record.file
        self.record = record
        self.manifest = manifest
        self.file: MappedFile | None = None
        self.segments: dict[tuple[int, str], Segment] = {}

    def open(self) -> MappedFile:
        if self.file is None:
            file = self._map()
            self._check(file)
            self.file = file
        return self.file

    def _map(self) -> MappedFile:
        """The mapped file, its errors saying what the manifest knows: the file's rank and size."""

        def truncated(exc: ValueError, size: int) -> str:
            return (
                f"{self.path}: truncated: {size} of {self.record.nbytes} bytes (the size the manifest records; a copy "
                f"or write that did not finish?): {str(exc).removeprefix(f'{self.path}: ')}"
            )

        return open_recorded(self.path, self.record, lambda: MappedFile(self.path), truncated)

    def _check(self, file: MappedFile) -> None:
        where, meta = str(self.path), file.header.metadata
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
        for key, value in expected.items():
            if meta.get(key) != value:
                found = escape(repr(meta.get(key)), limit=80)
                raise ValueError(
                    f"{where}: {key} is {found}, expected {value!r} from the manifest (a file of another "
                    "save?)"
                )
        if file.header.checksum != self.record.checksum:
            raise ValueError(
                f"{where}: header checksum {file.header.checksum} differs from the manifest's "
                f"{self.record.checksum}"
            )
        if file.size != self.record.nbytes:
            raise ValueError(f"{where}: {file.size} bytes, but the manifest records {self.record.nbytes}")
        tensors = {name: numel for name, (_, numel, _) in file.header.tensors.items()}
        self.segments = check_segments(
            self.record.segments,
            tensors,
            self.manifest.flat_params,
            self.record.rank,
            self.manifest.chunk_bytes,
            where=where,
        )

    def where(self, flat_index: int) -> str:
        flat = self.manifest.flat_params[flat_index]
        return f"{self.path}, unit '{flat.unit or '<root>'}' (flat parameter {flat_index})"

    def view(self, flat_index: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Verified zero-copy view of elements ``[start, stop)`` of this file's shard of ``key``."""
        file = self.open()
        segment, chunk = self.segments[(flat_index, key)], self.manifest.chunk_bytes
        return file.view(segment, start, stop, chunk, self.where(flat_index))

    def unit(self, flat_index: int, *, mapped: bool = True) -> dict[str, Any]:
        """One unit's entries: its verified shards (mapped views, or read into memory) and the manifest's scalars."""
        file = self.open()
        out: dict[str, Any] = {}
        for e in self.manifest.flat_params[flat_index].state:
            if e.kind is not StateKind.SHARDED:
                out[e.key] = clone_value(e.value)  # the optimizer owns what it loads: never the manifest's record
                continue
            s = self.segments[(flat_index, e.key)]
            chunk = self.manifest.chunk_bytes
            where = self.where(flat_index)
            out[e.key] = file.view(s, 0, s.numel, chunk, where) if mapped else file.read(s, chunk, where)
        return out

    def release(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = None


T = TypeVar("T")


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
