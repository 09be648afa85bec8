"""Writing a format-3 rank file: its layout before any of its data exists, and :func:`write_rank`, the one function
that writes its bytes (a job's save, an offline block re-cut, a re-cut streamed unit by unit, a team's byte ranges).

The header of a rank file does not depend on its data but through its chunk checksums, and each of those is a digest
of fixed length (:data:`DIGEST_PLACEHOLDER`'s). So the whole file is known up front: the header with placeholders
(its *skeleton*), where each tensor's data starts, and where in the header each chunk's digest goes::

    <u64 n> {"__metadata__": {..., "checksums": "{\\"float32\\":[\\"xxh3-128:000..0\\",\\"xxh3-128:000..0\\"]}"},
             "float32": {...}}  <float32 data: chunk 0 | chunk 1>
                                          ^ slot of chunk 0   ^ slot of chunk 1 (a fixed stride apart)

:func:`write_rank` writes runs of whole chunks of tensors at their offsets, hashing each piece while a thread writes
it (:class:`~fsdp_optim.disk.atomic.HashingWriter`), and fills their digests into the slots: one process
writes every tensor whole and then the whole header; a team's process writes one run (``span``) into a file laid out
beforehand (:func:`lay_out_file`) and fills that run's slots alone. Either trusts what it wrote as one process does (the
digests are of the bytes handed to the file, and the file is fsynced); once every run is written,
:func:`finished_record` reads the header back and checks that it is the skeleton with every slot filled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import torch

from fsdp_optim.core.checksums import ChunkHasher, digest
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.disk.atomic import HashingWriter
from fsdp_optim.disk.json_input import loads
from fsdp_optim.formats.sharded.file_record import CHECKPOINT_VERSION, FileRecord
from fsdp_optim.formats.sharded.manifest import Manifest, shard_file_name
from fsdp_optim.formats.sharded.rank_file import Pieces, host_pieces
from fsdp_optim.formats.sharded.safetensors_header import encode_rank_header, read_rank_header
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES, chunk_elements, file_layout, manifest_shards

__all__ = ["DIGEST_PLACEHOLDER", "LaidOutFile", "TensorPlace", "finished_record", "lay_out_file", "laid_out",
           "rank_layout", "shard_metadata", "write_rank"]  # fmt: skip

DIGEST_PLACEHOLDER = "xxh3-128:" + "0" * 32  # a digest's length: the header is written once the data has been hashed
_SLOT = len(DIGEST_PLACEHOLDER)


@dataclass(frozen=True)
class TensorPlace:
    """One tensor of a laid-out file: ``numel`` elements of ``itemsize`` bytes from file offset ``data``, chunks of
    ``per`` elements whose digests go at header offsets ``first_slot + k * stride``."""

    name: str
    numel: int
    itemsize: int
    per: int
    data: int
    first_slot: int
    stride: int


@dataclass(frozen=True)
class LaidOutFile:
    """Rank ``rank``'s file ``name`` before its data: the header skeleton, its tensors, its size."""

    name: str
    rank: int
    header: bytes
    tensors: tuple[TensorPlace, ...]
    size: int


def shard_metadata(save_id: str, rank: int, world_size: int) -> dict[str, str]:
    """A rank file's header metadata before the writer adds its chunk size and checksums."""
    return {"format": "fsdp_optim", "kind": "shard", "version": str(CHECKPOINT_VERSION), "save_id": save_id,
            "rank": str(rank), "world_size": str(world_size)}  # fmt: skip


def laid_out(final: Manifest, rank: int) -> LaidOutFile:
    """The layout of rank ``rank``'s file of the checkpoint ``final`` describes (its save id, world size, units)."""
    _, sizes = file_layout(manifest_shards(final.flat_params, ShardIndex.of(final.flat_params)))
    name = shard_file_name(final.save_id, rank, final.world_size)
    return rank_layout(shard_metadata(final.save_id, rank, final.world_size), sizes, name=name, rank=rank)


def rank_layout(
    metadata: Mapping[str, str], sizes: Mapping[str, int], chunk_bytes: int = CHUNK_BYTES, *, name: str = "",
    rank: int = 0,
) -> LaidOutFile:  # fmt: skip
    """The layout of a rank file with header ``metadata`` whose tensor ``t`` holds ``sizes[t]`` elements (in order)."""
    per = {t: chunk_elements(dtype_from_str(t, where="state"), chunk_bytes) for t in sizes}
    text = json.dumps({t: [DIGEST_PLACEHOLDER] * -(-n // per[t]) for t, n in sizes.items()}, separators=(",", ":"))
    header = encode_rank_header({**metadata, "chunk_bytes": str(chunk_bytes), "checksums": text}, sizes)
    slots = _slots(header)
    tensors, at, k = [], len(header), 0
    for t, n in sizes.items():
        itemsize, chunks = dtype_from_str(t, where="state").itemsize, -(-n // per[t])
        mine = slots[k : k + chunks]
        stride = mine[1] - mine[0] if chunks > 1 else 0
        if any(b - a != stride for a, b in zip(mine, mine[1:])):
            raise RuntimeError(f"rank file {rank}: the digests of tensor {t} are not evenly spaced in its header")
        tensors.append(TensorPlace(t, n, itemsize, per[t], at, mine[0] if chunks else 0, stride))
        at, k = at + n * itemsize, k + chunks
    if k != len(slots):
        raise RuntimeError(f"rank file {rank}: {len(slots)} digest slots in its header, expected {k}")
    return LaidOutFile(name, rank, header, tuple(tensors), at)


def _slots(header: bytes) -> list[int]:
    """The offsets of every placeholder digest in ``header``, in order."""
    mark, found, at = DIGEST_PLACEHOLDER.encode(), [], header.find(DIGEST_PLACEHOLDER.encode())
    while at >= 0:
        found.append(at)
        at = header.find(mark, at + _SLOT)
    return found


def write_rank(
    file: BinaryIO | Path, layout: LaidOutFile, parts: Mapping[str, Iterable[torch.Tensor]], *,
    span: tuple[int, int, int] | None = None, pieces: Pieces = host_pieces, after: Callable[[int], None] | None = None,
) -> str:  # fmt: skip
    """Write ``layout``'s tensor ``t`` as the concatenation of the 1-D ``parts[t]``, each read once through
    ``pieces``; returns the header's digest (the manifest's record of the file).

    Without ``span``, ``file`` is open at the file's start: every tensor and then the header (the module docstring),
    the file left at its end. With ``span`` ``(tensor, start, stop)`` (elements, whole chunks), ``file`` is the path
    of the file :func:`lay_out_file` made, of which that run alone is written, its digests into their slots, then
    fsynced. ``after(nbytes)``: after each part (and then each part is asked of
    ``pieces`` on its own)."""
    runs = [(k, 0, t.numel) for k, t in enumerate(layout.tensors)] if span is None else [span]
    header = bytearray(layout.header)
    opened = nullcontext(cast(BinaryIO, file)) if span is None else _laid_out(cast(Path, file))
    with opened as f, HashingWriter(f) as writer:
        start = f.tell()
        for k, lo, hi in runs:
            t = layout.tensors[k]
            if lo % t.per or (hi % t.per and hi != t.numel) or not 0 <= lo <= hi <= t.numel:
                raise ValueError(f"{file}: elements [{lo}, {hi}) of {t.name} are not whole chunks of {t.per}")
            hasher, at = ChunkHasher(t.name, t.itemsize, t.per, hi - lo), start + t.data + lo * t.itemsize
            f.seek(at)
            for group in ([parts[t.name]] if after is None else ([p] for p in parts[t.name])):
                done = at
                for piece in pieces(group):  # type: ignore[arg-type]
                    raw = memoryview(piece.numpy()).cast("B")  # type: ignore[arg-type]
                    writer.put(raw, hasher.update)
                    at += len(raw)
                if after is not None:
                    after(at - done)
            if at != start + t.data + hi * t.itemsize:
                raise RuntimeError(f"{file}: {t.name} [{lo}, {hi}): {at - start - t.data} bytes written, expected more")
            for j, d in enumerate(hasher.digests(), start=lo // t.per):
                header[t.first_slot + j * t.stride : t.first_slot + j * t.stride + _SLOT] = d.encode()
        first, last = (0, len(header)) if span is None else _slot_range(layout.tensors[span[0]], span)
        f.seek(start + first)
        writer.put(memoryview(header)[first:last], lambda _: None)
        f.seek(start + layout.size)
    return digest(bytes(header[8:]))


def _slot_range(t: TensorPlace, span: tuple[int, int, int]) -> tuple[int, int]:
    """The header bytes holding the digests of ``span``'s chunks (empty when it has none)."""
    first, count = span[1] // t.per, -(-span[2] // t.per) - span[1] // t.per
    lo = t.first_slot + first * t.stride
    return (lo, lo + (count - 1) * t.stride + _SLOT) if count else (lo, lo)


@contextmanager
def _laid_out(path: Path) -> Iterator[BinaryIO]:
    """The laid-out file at ``path`` opened unbuffered for writing, fsynced once written."""
    with open(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+b", buffering=0) as f:
        yield f
        os.fsync(f.fileno())


def lay_out_file(path: Path, layout: LaidOutFile) -> None:
    """Create ``path`` (exclusively), ``layout.size`` bytes long, write the header skeleton, fsync. A failure removes
    the file. Its data's blocks are not reserved (a hole-filled file): each writer's runs fill them as one process's
    writes do, so no process reserves (on tmpfs: allocates) the blocks of a whole file before any is written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        done = 0
        while done < len(layout.header):
            done += os.pwrite(fd, layout.header[done:], done)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def finished_record(path: Path, layout: LaidOutFile) -> FileRecord:
    """The record of a laid-out file once every chunk was written: ``ValueError`` unless its size is the layout's and
    its header is the skeleton with every digest slot filled (a digest, no placeholder left)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size != layout.size:
            raise ValueError(f"{path}: {size} bytes, expected {layout.size}")
        header = os.pread(fd, len(layout.header), 0)
        meta = read_rank_header(fd, size, str(path)).metadata
    finally:
        os.close(fd)
    sums = loads(meta.get("checksums", "null").encode(), where=f"{path}: checksums")
    if not isinstance(sums, dict) or any(DIGEST_PLACEHOLDER in v for v in sums.values() if isinstance(v, list)):
        raise ValueError(f"{path}: a chunk's digest was not written (a placeholder is left in its header)")
    filled = bytearray(layout.header)
    for t in layout.tensors:
        for k, d in enumerate(sums.get(t.name, ())):
            at = t.first_slot + k * t.stride
            filled[at : at + _SLOT] = str(d).encode()[:_SLOT]
    if bytes(filled) != header:
        raise ValueError(f"{path}: its header is not the one laid out, with its digests filled in")
    return FileRecord(layout.rank, layout.name, digest(header[8:]), size)

