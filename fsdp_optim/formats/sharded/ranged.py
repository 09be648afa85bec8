"""A format-3 rank file laid out before any of its data exists, so that several processes can fill it at once.

The header of a rank file does not depend on its data but through its chunk checksums, and each of those is a digest
of fixed length (:data:`~.rank_file.DIGEST_PLACEHOLDER`'s). So the whole file is known up front: the header with
placeholders (its *skeleton*), where each tensor's data starts, and where in the header each chunk's digest goes::

    <u64 n> {"__metadata__": {..., "checksums": "{\\"float32\\":[\\"xxh3-128:000..0\\",\\"xxh3-128:000..0\\"]}"},
             "float32": {...}}  <float32 data: chunk 0 | chunk 1>
                                          ^ slot of chunk 0   ^ slot of chunk 1 (a fixed stride apart)

One process lays the file out (:func:`lay_out_file`: created, preallocated, the skeleton written); then any process
writes a run of whole chunks of a tensor at their offsets and its digests into their slots
(:func:`write_chunks`); once every run is written, :func:`finished_record` reads the header back and checks that it
is the skeleton with every slot filled, and returns the file's record. The bytes are exactly those of
:func:`~.rank_file.write_rank_tensors` for the same data (the same header encoder, the same digests).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_optim.core.checksums import ChunkHasher, digest
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.disk.json_input import loads
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import Manifest, shard_file_name
from fsdp_optim.formats.sharded.rank_file import DIGEST_PLACEHOLDER
from fsdp_optim.formats.sharded.safetensors_header import encode_rank_header, read_rank_header
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES, chunk_elements, file_layout, manifest_shards
from fsdp_optim.formats.sharded.writer import shard_metadata

__all__ = ["LaidOutFile", "TensorPlace", "finished_record", "lay_out_file", "laid_out", "write_chunks"]

_SLOT = len(DIGEST_PLACEHOLDER)
_CHECK_BYTES = 8 << 20  # read back in pieces of at most this


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

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class LaidOutFile:
    """Output rank ``rank``'s file ``name`` before its data: the header skeleton, its tensors, its size."""

    name: str
    rank: int
    header: bytes
    tensors: tuple[TensorPlace, ...]
    size: int


def laid_out(final: Manifest, rank: int) -> LaidOutFile:
    """The layout of rank ``rank``'s file of the checkpoint ``final`` describes (its save id, world size, units)."""
    _, sizes = file_layout(manifest_shards(final.flat_params, ShardIndex.of(final.flat_params)))
    per = {name: chunk_elements(dtype_from_str(name, where="state"), CHUNK_BYTES) for name in sizes}
    text = json.dumps({name: [DIGEST_PLACEHOLDER] * -(-n // per[name]) for name, n in sizes.items()},
                      separators=(",", ":"))  # fmt: skip
    meta = {**shard_metadata(final.save_id, rank, final.world_size), "chunk_bytes": str(CHUNK_BYTES)}
    header = encode_rank_header({**meta, "checksums": text}, sizes)
    slots = _slots(header)
    tensors, at, k = [], len(header), 0
    for name, n in sizes.items():
        itemsize, chunks = dtype_from_str(name, where="state").itemsize, -(-n // per[name])
        mine = slots[k : k + chunks]
        stride = mine[1] - mine[0] if chunks > 1 else 0
        if any(b - a != stride for a, b in zip(mine, mine[1:])):
            raise RuntimeError(f"rank file {rank}: the digests of tensor {name} are not evenly spaced in its header")
        tensors.append(TensorPlace(name, n, itemsize, per[name], at, mine[0] if chunks else 0, stride))
        at, k = at + n * itemsize, k + chunks
    if k != len(slots):
        raise RuntimeError(f"rank file {rank}: {len(slots)} digest slots in its header, expected {k}")
    return LaidOutFile(shard_file_name(final.save_id, rank, final.world_size), rank, header, tuple(tensors), at)


def _slots(header: bytes) -> list[int]:
    """The offsets of every placeholder digest in ``header``, in order."""
    mark, found, at = DIGEST_PLACEHOLDER.encode(), [], header.find(DIGEST_PLACEHOLDER.encode())
    while at >= 0:
        found.append(at)
        at = header.find(mark, at + _SLOT)
    return found


def lay_out_file(path: Path, layout: LaidOutFile, preallocate: Callable[[int, int], None]) -> None:
    """Create ``path`` (exclusively), make it ``layout.size`` bytes (``preallocate(fd, size)``), write the header
    skeleton, fsync. A failure removes the file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        preallocate(fd, layout.size)
        _write_all(fd, layout.header, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def write_chunks(
    path: Path, layout: LaidOutFile, tensor: int, start: int, stop: int, pieces: Iterable[torch.Tensor],
    *, after: Callable[[int], None],
) -> None:  # fmt: skip
    """Elements ``[start, stop)`` of tensor ``tensor`` of the laid-out file ``path`` (``start`` on a chunk boundary,
    ``stop`` on one or the tensor's end), given as 1-D ``pieces`` in order: each written at its offset and read back,
    their chunks' digests written into their header slots and read back, then fsync. ``after(nbytes)`` after each
    piece."""
    t = layout.tensors[tensor]
    if start % t.per or (stop % t.per and stop != t.numel) or not 0 <= start <= stop <= t.numel:
        raise ValueError(f"{path}: elements [{start}, {stop}) of {t.name} are not whole chunks of {t.per}")
    hasher = ChunkHasher(t.name, t.itemsize, t.per, stop - start)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        at = t.data + start * t.itemsize
        for piece in pieces:
            raw = memoryview(piece.detach().contiguous().view(torch.uint8).numpy().data).cast("B")
            hasher.update(raw)
            _write_all(fd, raw, at)
            _check_back(fd, raw, at, path)
            at += len(raw)
            after(len(raw))
        if at != t.data + stop * t.itemsize:
            raise RuntimeError(f"{path}: {t.name} [{start}, {stop}): pieces of {at - t.data} bytes, expected more")
        digests = hasher.digests()
        if digests:
            first = t.first_slot + start // t.per * t.stride
            slots = bytearray(layout.header[first : first + (len(digests) - 1) * t.stride + _SLOT])
            for k, d in enumerate(digests):
                slots[k * t.stride : k * t.stride + _SLOT] = d.encode()
            _write_all(fd, slots, first)
            _check_back(fd, memoryview(slots), first, path)
        os.fsync(fd)
    finally:
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


def _write_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _check_back(fd: int, data: memoryview, offset: int, path: Path) -> None:
    """``OSError`` unless the file holds ``data`` at ``offset`` (read back in pieces)."""
    for at in range(0, len(data), _CHECK_BYTES):
        piece = data[at : at + _CHECK_BYTES]
        if os.pread(fd, len(piece), offset + at) != piece.tobytes():  # bytes to bytes: a memcmp, not item by item
            raise OSError(f"{path}: the bytes read back at offset {offset + at} differ from those written")
