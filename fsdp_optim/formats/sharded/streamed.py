"""A rank file of a re-cut written one shard at a time, and a written rank file checked against its own header.

:func:`write_streamed` writes output rank ``r`` of a plan as :func:`~.writer.write_shard_file` would (the same bytes:
the same :func:`~.segments.file_layout`, metadata and chunk checksums), but cuts each ``(unit, state key)`` shard
only when the writer reaches it (:func:`~fsdp_optim.core.execute.cut_rank` of :func:`~fsdp_optim.core.execute.restrict`)
and drops it once written: memory holds one shard of one unit, never the rank's whole state::

    output rank 1, tensors float32 = [u0/exp_avg | u0/exp_avg_sq | u2/exp_avg ...], bfloat16 = [u0/@param ...]
    each | ... | cut from the source's ranges, hashed into its chunks, written, released

:func:`check_written` reads a written file back and checks its size, its header's digest (the manifest's record)
and every chunk of data against the header's checksums: what the parallel re-cut runs before it agrees to commit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import torch

from fsdp_optim.core.checksums import ChunkHasher
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.execute import cut_rank, restrict
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.source import Plan
from fsdp_optim.disk.json_input import loads
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.rank_file import Pieces, host_pieces
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.formats.sharded.segments import chunk_elements, file_layout, manifest_shards
from fsdp_optim.formats.sharded.writer import write_shard_parts

__all__ = ["check_written", "rank_file_bytes", "write_streamed"]

_READ_BYTES = 8 << 20


class _Shards(Sequence[torch.Tensor]):
    """The shards of one tensor of output rank ``rank``, each cut when asked for (``after`` runs after each)."""

    def __init__(self, the_plan: Plan, rank: int, keys: list[tuple[int, str]], after: Callable[[], None]) -> None:
        self.plan, self.rank, self.keys, self.after = the_plan, rank, keys, after

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        flat, key = self.keys[i]
        shard = cut_rank(restrict(self.plan, flat, key), self.rank)[flat][key]
        self.after()
        return shard

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[k] for k in range(len(self)))


def _layout(final: Manifest) -> tuple[dict[str, list[tuple[int, str]]], dict[str, int]]:
    """``{tensor: [(flat, key) in file order]}`` and ``{tensor: numel}`` of every rank file of ``final``."""
    where, sizes = file_layout(manifest_shards(final.flat_params, ShardIndex.of(final.flat_params)))
    keys: dict[str, list[tuple[int, str]]] = {name: [] for name in sizes}
    for (flat, key), (tensor, _, _) in sorted(where.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        keys[tensor].append((flat, key))
    return keys, sizes


def rank_file_bytes(final: Manifest) -> int:
    """The data bytes of each rank file of ``final`` (every rank's file holds as many: shards are padded)."""
    _, sizes = _layout(final)
    return sum(n * dtype_from_str(name, where="state").itemsize for name, n in sizes.items())


def write_streamed(
    directory: Path, the_plan: Plan, final: Manifest, rank: int, *, after_shard: Callable[[], None],
    pieces: Pieces = host_pieces,
) -> FileRecord:  # fmt: skip
    """Write output rank ``rank`` of ``final`` (``the_plan``'s target, save id and world size) into the staging
    ``directory``, one shard at a time (module docstring); ``after_shard`` runs after each shard is cut (to release
    the source's mappings), ``pieces`` serves each shard's bytes to the writer (a caller counts them there)."""
    keys, sizes = _layout(final)
    parts = {name: _Shards(the_plan, rank, keys[name], after_shard) for name in sizes}
    return write_shard_parts(directory, parts, sizes, save_id=final.save_id, rank=rank, world_size=final.world_size,
                             pieces=pieces)  # fmt: skip


def check_written(path: Path, record: FileRecord) -> None:
    """``ValueError`` unless the file at ``path`` is ``record``'s (size, header digest) and every chunk of its data
    matches its header's checksums (read back in 8 MiB pieces)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != record.nbytes:
            raise ValueError(f"{path}: {size} bytes written, expected {record.nbytes}")
        header = read_rank_header(fd, size, str(path))
        if header.checksum != record.checksum:
            raise ValueError(f"{path}: header digest {header.checksum}, expected {record.checksum}")
        chunk_bytes = int(header.metadata["chunk_bytes"])
        expected = loads(header.metadata["checksums"].encode(), where=str(path))
        for name, (_, numel, start) in header.tensors.items():
            dtype = dtype_from_str(name, where=str(path))
            hasher = ChunkHasher(name, dtype.itemsize, chunk_elements(dtype, chunk_bytes), numel)
            end = start + numel * dtype.itemsize
            for at in range(start, end, _READ_BYTES):
                hasher.update(memoryview(os.pread(fd, min(_READ_BYTES, end - at), at)))
            if list(hasher.digests()) != list(expected.get(name, ())):
                raise ValueError(f"{path}: tensor {name}: the data read back does not match its chunk checksums")
    finally:
        os.close(fd)
