"""Format-1 rank files (torch files, read through the pickle gate): checked against the manifest, one unit at a time.

Never imports ``torch.distributed``. A format-1 rank file (:mod:`.torch_files`) holds
``{HEADER_KEY: {...}, "unit_checksums": {flat: digest}, "state": {flat: {key: padded shard or scalar}}}``;
each unit's digest is checked the first time the unit is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.checksums import digest_matches
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind, same_scalar, show_value
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.disk.objects import check_tree
from fsdp_optim.disk.untrusted import check_stored_bytes, load_file
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.rank_file import open_recorded
from fsdp_optim.formats.sharded.torch_files import check_checksum, read_torch_header

__all__ = ["LegacyRankFile"]


def _declared_bytes(manifest: Manifest, shards: ShardIndex) -> int:
    """Bytes of sharded state the manifest says every rank file holds (one shard of each unit, padding
    included; a unit over one rank whole): a file smaller than that was not written from this manifest."""
    total = 0
    for i, flat in enumerate(manifest.flat_params):
        shard_numel = shards.shard_numel(i)
        for e in flat.state:
            if e.kind is StateKind.SHARDED:
                total += shard_numel * dtype_from_str(e.dtype, where=e.key).itemsize
    return total


class LegacyRankFile:
    """One rank file, mapped lazily; its header is checked against the manifest on first use. Read as a
    :class:`~.rank_file.RankFile` is (``open``, ``unit``, ``view``, ``load_all``, ``drop``, ``release``)."""

    def __init__(self, directory: Path, record: FileRecord, manifest: Manifest, shards: ShardIndex) -> None:
        self.path = directory / record.file
        self.record = record
        self.manifest = manifest
        self.shards = shards
        self.payload: Mapping[str, Any] | None = None
        self.verified: set[int] = set()

    def open(self, *, mmap: bool = True) -> Mapping[str, Any]:
        if self.payload is None:
            # A rank file's name comes from the manifest: it must be a regular file inside the directory.
            payload = self._load(mmap=mmap)
            self._check_header(payload)
            # What the manifest's shapes make readers allocate is bounded by what the files really hold
            # (and by what the manifest itself says they hold).
            declared = _declared_bytes(self.manifest, self.shards)
            check_stored_bytes(str(self.path), declared, self.path.stat().st_size)
            check_stored_bytes(f"{self.path} (as the manifest records it)", declared, self.record.nbytes)
            self.payload = payload
        return self.payload

    def _load(self, *, mmap: bool) -> Any:
        """:func:`load_file`, its errors saying what the manifest knows: the file's rank and size."""

        def truncated(exc: ValueError, size: int) -> str | None:
            if "cannot be read with torch.load" not in str(exc):
                return None  # readable but refused (a forged file): that refusal says what is wrong
            return (
                f"{self.path}: cannot be read with torch.load(weights_only=True): truncated: {size} of "
                f"{self.record.nbytes} bytes (the size the manifest records; a copy or write that did not finish?)"
            )

        return open_recorded(self.path, self.record, lambda: load_file(self.path, mmap=mmap, follow_symlinks=False),
                             truncated)

    def _check_header(self, payload: Any) -> None:
        where = str(self.path)
        head, checksum = read_torch_header(
            payload, "shard", source=where, covered="unit_checksums", what="fsdp_optim rank file"
        )
        check_tree(payload, where)
        if "state" not in payload:
            raise ValueError(f"{where}: expected an fsdp_optim rank file, found keys {sorted(map(str, payload))}")
        for key in ("state", "unit_checksums"):
            if not isinstance(payload[key], Mapping):
                raise ValueError(
                    f"{where}: '{key}' is a {type(payload[key]).__name__}, expected a dict by flat parameter"
                )
        expected = {
            "save_id": self.manifest.save_id,
            "rank": self.record.rank,
            "world_size": self.manifest.world_size,
        }
        for key, value in expected.items():
            if head.get(key) != value:
                raise ValueError(
                    f"{where}: {key} is {head.get(key)!r}, expected {value!r} from the manifest (a file of another "
                    "save?)"
                )
        if checksum != self.record.checksum:
            raise ValueError(f"{where}: checksum {checksum} differs from the manifest's {self.record.checksum}")
        check_checksum(head, checksum, payload["unit_checksums"], source=where)

    def unit(self, flat_index: int, *, mmap: bool = True) -> Mapping[str, Any]:
        """The verified entries of one flat parameter (mapped: copy what you keep)."""
        payload = self.open(mmap=mmap)
        flat = self.manifest.flat_params[flat_index]
        where = f"{self.path}, unit '{flat.unit or '<root>'}' (flat parameter {flat_index})"
        entries = payload["state"].get(flat_index)
        if entries is None or not isinstance(entries, Mapping):
            raise ValueError(
                f"{where}: no state in the file, but the manifest lists keys {[e.key for e in flat.state]}"
            )
        if flat_index not in self.verified:
            if not digest_matches(entries, payload["unit_checksums"].get(flat_index)):
                raise ValueError(f"{where}: checksum mismatch (file is corrupt or was modified)")
            shard_numel = self.shards.shard_numel(flat_index)
            if set(entries) != {e.key for e in flat.state}:
                raise ValueError(f"{where}: state keys {sorted(entries)}, expected {[e.key for e in flat.state]}")
            for e in flat.state:
                value = entries[e.key]
                if e.kind is StateKind.SHARDED:
                    dtype = dtype_from_str(e.dtype, where=where)
                    if not torch.is_tensor(value) or tuple(value.shape) != (shard_numel,) or value.dtype != dtype:
                        found = (
                            f"{tuple(value.shape)} {value.dtype}" if torch.is_tensor(value) else type(value).__name__
                        )
                        raise ValueError(f"{where}: state '{e.key}' is {found}, expected ({shard_numel},) {dtype}")
                elif not same_scalar(value, e.value):
                    # Every reader must resume the same way: the manifest's value is what offline tools use.
                    raise ValueError(
                        f"{where}: scalar state '{e.key}' is {show_value(value)}, but the manifest records "
                        f"{show_value(e.value)}"
                    )
            self.verified.add(flat_index)
        return entries

    def view(self, flat_index: int, key: str, start: int, stop: int) -> torch.Tensor:
        return self.unit(flat_index)[key][start:stop]

    def load_all(self) -> dict[int, dict[str, Any]]:
        """Every unit's entries, read into memory (not mapped) and verified."""
        self.release()  # (mapped by an open_all(): read again, into memory)
        return {i: dict(self.unit(i, mmap=False)) for i, flat in enumerate(self.manifest.flat_params) if flat.state}

    def release(self) -> None:
        self.payload = None
        self.verified.clear()

    drop = release  # nothing to keep mapped: a unit read again is loaded again
