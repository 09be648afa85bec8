"""Rank files (formats 2 and 3): safetensors files written as a stream, read by byte range through one mapping.

A format-3 rank file (see :mod:`.segments` for where each shard lies in it)::

    <u64 n> {"__metadata__": {"format": "fsdp_optim", "kind": "shard", "version": "3", "save_id": "3f2a...",
                              "rank": "0", "world_size": "2", "chunk_bytes": "65536",
                              "checksums": "{\"float32\": [\"xxh3-128:...\", ...]}"},    # JSON in a string
             "float32": {"dtype": "F32", "shape": [184], "data_offsets": [0, 736]}, ...}   <data>

one 1-D tensor per dtype; the manifest records the digest of the header (which covers the chunk checksums)
and the file's size. Any safetensors reader opens it (``safetensors.safe_open(path, framework="pt")``). We
write it ourselves, streaming each shard's bytes straight from the optimizer's tensors:
``safetensors.torch.save_file`` takes a dict of whole tensors, which would cost a copy of the rank's state
to concatenate them. A format-2 file is the same without ``chunk_bytes`` and ``checksums`` (its manifest
lists them per segment). The one writer is :func:`~.ranged.write_rank`; this module reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.disk.json_input import RefusedJSON, loads
from fsdp_optim.disk.location import Location, ObjectPath
from fsdp_optim.disk.text import escape
from fsdp_optim.disk.untrusted import open_regular
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.mapped import MappedFile
from fsdp_optim.formats.sharded.safetensors_header import read_rank_header
from fsdp_optim.formats.sharded.segments import (
    Grid,
    Placement,
    check_segments,
    grids_v3,
    placements_v2,
)

__all__ = [
    "FileLayout",
    "Pieces",
    "RankFile",
    "describe_rank_file",
    "host_pieces",
    "open_recorded",
]

_WRITE_BYTES = 8 << 20  # bytes per write call
FileLayout = tuple[Mapping[tuple[int, str], tuple[str, int, int]], Mapping[str, int]]  # segments.file_layout's


Pieces = Callable[[Sequence[torch.Tensor]], Iterator[torch.Tensor]]
"""``pieces(parts)``: the bytes of the 1-D tensors ``parts``, in order, as CPU ``uint8`` tensors; each valid only
until the next is asked for (a staging ring may reuse its memory then). :func:`host_pieces` serves tensors already
in host memory; a job hands the writer its device-to-host stager's (:mod:`fsdp_optim.job.stager`)."""


def host_pieces(parts: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The bytes of ``parts`` without a copy, at most 8 MiB a piece (a tensor on a device is copied to the host
    first, whole: a job passes its stager instead)."""
    for part in parts:
        raw = part.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), _WRITE_BYTES):
            yield raw[start : start + _WRITE_BYTES]


def describe_rank_file(path: Path) -> list[str]:
    """What ``fsdp-optim inspect`` prints about one rank file of format 2 or 3 (its checked header only)."""
    fd, st = open_regular(path)
    try:
        header = read_rank_header(fd, st.st_size, str(path))
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


class RankFile:
    """One rank file of a checkpoint (format 2 or 3), opened (mapped, header checked against the manifest) on first
    use. ``layout``: where the manifest's units put each shard in every format-3 file (``segments.file_layout``),
    computed once per checkpoint; unused for format 2, whose manifest lists each file's segments."""

    def __init__(
        self, directory: Location, record: FileRecord, manifest: Manifest, layout: FileLayout, *, mapped: Path | None
    ) -> None:
        """``mapped``: the local directory holding ``directory``'s objects as files, which are mapped in place;
        ``None``: read by byte ranges (:meth:`~fsdp_optim.disk.location.Location.read_into`)."""
        self.directory = directory
        self.mapped = mapped
        self.path: Path | ObjectPath = directory / record.file  # as messages name it
        self.record = record
        self.manifest = manifest
        self.layout = layout
        self.file: MappedFile | None = None
        self.provided: Callable[[], MappedFile] | None = None  # opens its bytes as the caller holds them instead
        self.grids: dict[str, Grid] = {}  # format 3: per tensor
        self.placements: dict[tuple[int, str], Placement] = {}  # format 2: per shard

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

        if self.provided is not None:
            return self.provided()
        if self.mapped is None:
            return _open_remote(self.directory, self.record, truncated)
        path = self.mapped / self.record.file
        return open_recorded(path, self.record, lambda: MappedFile(path), truncated)

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
        if self.manifest.version >= 3:
            expected["chunk_bytes"] = str(self.manifest.chunk_bytes)
        for key, value in expected.items():
            if meta.get(key) != value:
                found = escape(repr(meta.get(key)), limit=80)
                raise ValueError(
                    f"{where}: {key} is {found}, expected {value!r} from the manifest (a file of another save?)"
                )
        if file.header.checksum != self.record.checksum:
            raise ValueError(
                f"{where}: header checksum {file.header.checksum} differs from the manifest's {self.record.checksum}"
            )
        if file.size != self.record.nbytes:
            raise ValueError(f"{where}: {file.size} bytes, but the manifest records {self.record.nbytes}")
        tensors = {name: numel for name, (_, numel, _) in file.header.tensors.items()}
        if self.manifest.version >= 3:
            checksums, chunk, units = _checksums(meta, where), self.manifest.chunk_bytes, self.manifest.flat_params
            self.grids = grids_v3(checksums, self.layout, tensors, chunk, where=where, units=units)
            return
        segments = check_segments(
            self.record.segments, tensors, self.manifest.flat_params, self.record.rank, self.manifest.chunk_bytes,
            where=where,
        )  # fmt: skip
        self.placements = placements_v2(segments)

    def where(self, flat_index: int) -> str:
        flat = self.manifest.flat_params[flat_index]
        return f"{self.path}, unit '{flat.unit or '<root>'}' (flat parameter {flat_index})"

    def placement(self, flat_index: int, key: str) -> Placement:
        """Where this file holds its shard of ``key`` of flat parameter ``flat_index`` (the file must be open)."""
        if not self.grids:
            return self.placements[(flat_index, key)]
        tensor, offset, numel = self.layout[0][(flat_index, key)]
        return Placement(flat_index, key, tensor, offset, numel, self.grids[tensor])

    def view(self, flat_index: int, key: str, start: int, stop: int) -> torch.Tensor:
        """Verified zero-copy view of elements ``[start, stop)`` of this file's shard of ``key``."""
        file = self.open()
        p = self.placement(flat_index, key)
        return file.view(p, start, stop, self.manifest.chunk_bytes, self.where(flat_index))

    def unit(self, flat_index: int, *, mapped: bool = True) -> dict[str, Any]:
        """One unit's entries: its verified shards (mapped views, or read into memory) and the manifest's scalars."""
        file = self.open()
        out: dict[str, Any] = {}
        for e in self.manifest.flat_params[flat_index].state:
            if e.kind is not StateKind.SHARDED:
                out[e.key] = clone_value(e.value)  # the optimizer owns what it loads: never the manifest's record
                continue
            p, chunk, where = self.placement(flat_index, e.key), self.manifest.chunk_bytes, self.where(flat_index)
            out[e.key] = file.view(p, 0, p.numel, chunk, where) if mapped else file.read(p, chunk, where)
        return out

    def load_all(self) -> dict[int, dict[str, Any]]:
        """Every unit's entries read into memory, each shard a tensor of its own (as the optimizer will hold them):
        format 3 verifies each dtype's shards in one pass over its chunks; format 2 shard by shard."""
        self.open()
        flats = self.manifest.flat_params
        if not self.grids:
            return {i: self.unit(i, mapped=False) for i, flat in enumerate(flats) if flat.state}
        shards: dict[tuple[int, str], torch.Tensor] = {}
        for name in self.grids:  # each tensor's shards in file order, read and verified as one pass
            order = sorted((at, n, key) for key, (t, at, n) in self.layout[0].items() if t == name)
            read = self.open().read_parts(
                self.grids[name], [(at, n) for at, n, _ in order], self.manifest.chunk_bytes, str(self.path),
                partial(self.holds, name),
            )  # fmt: skip
            shards.update({key: tensor for (_, _, key), tensor in zip(order, read)})
        out: dict[int, dict[str, Any]] = {}
        for i, flat in enumerate(flats):
            for e in flat.state:
                value = shards[(i, e.key)] if e.kind is StateKind.SHARDED else clone_value(e.value)
                out.setdefault(i, {})[e.key] = value
        return out

    def holds(self, tensor: str, lo: int, hi: int) -> str:
        """Which shards elements ``[lo, hi)`` of ``tensor`` belong to, for an error message."""
        hits = [(f, k) for (f, k), (t, at, n) in self.layout[0].items() if t == tensor and at < hi and at + n > lo]
        if not hits:
            return ""
        unit = self.manifest.flat_params[hits[0][0]].unit or "<root>"
        more = f" and {len(hits) - 1} more shards" if len(hits) > 1 else ""
        return f", unit '{unit}' state '{hits[0][1]}'{more}"

    def read_whole(self, tensor: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Format 3: tensor ``tensor`` read whole (into ``out`` if given) and verified; a mismatch names the units."""
        file = self.open()
        holds = partial(self.holds, tensor)
        return file.read_tensor(self.grids[tensor], self.manifest.chunk_bytes, str(self.path), out, holds)

    def release(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = None


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


def _open_remote(
    directory: Location, record: FileRecord, truncated: Callable[[ValueError, int], str]
) -> MappedFile:
    """The rank file ``record`` names in ``directory``, read by ranges (one size query, two ranged reads for its
    header), its errors saying what the manifest knows, as :func:`open_recorded` does for a mapped file."""
    from fsdp_optim.formats.sharded.remote_file import RemoteFile  # the ranged reader, only where one is used

    path = directory / record.file
    size = directory.size(record.file)
    if size is None:
        raise FileNotFoundError(
            f"{path}: no such object: the manifest lists it as rank {record.rank}'s file of {record.nbytes} bytes "
            "(the checkpoint is damaged; fsdp-optim verify checks every file)"
        )
    if size < record.nbytes:
        raise ValueError(truncated(ValueError(f"{path}: {size} bytes"), size))
    return RemoteFile(directory, record.file, size)


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
