"""One file of a sharded checkpoint as its manifest records it: name, checksum, size (format 2: its segments).

Pure records, no file access. ``CHECKPOINT_VERSION`` is the format every writer writes (1 and 2 stay readable);
``HEADER_KEY`` the key of every file's header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_optim.core.records import get_checked
from fsdp_optim.formats.sharded.segments import ShardSegment

__all__ = ["CHECKPOINT_VERSION", "HEADER_KEY", "FileRecord"]

CHECKPOINT_VERSION = 3  # what every writer writes; 1 and 2 stay readable
HEADER_KEY = "fsdp_optim_checkpoint"  # the key of the header in every file of ours (JSON manifest, torch files)


@dataclass(frozen=True)
class FileRecord:
    """One rank file: its name inside the checkpoint directory, checksum and size in bytes; in format 2 also
    where each shard lies in it (``segments``; format 3 derives that from the units: see :mod:`.segments`)."""

    rank: int
    file: str
    checksum: str
    nbytes: int
    segments: tuple[ShardSegment, ...] = ()

    def to_dict(self, version: int = CHECKPOINT_VERSION) -> dict[str, Any]:
        d = {"rank": self.rank, "file": self.file, "checksum": self.checksum, "bytes": self.nbytes}
        return {**d, "segments": [s.to_dict() for s in self.segments]} if version == 2 else d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str, version: int = CHECKPOINT_VERSION) -> FileRecord:
        name = get_checked(d, "file", str, where)
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ValueError(f"{where}: file name must be a plain name inside the checkpoint directory, found {name!r}")
        segments: tuple[ShardSegment, ...] = ()
        if version == 2:  # format 3 derives them (segments.file_layout); format 1 had none
            segments = tuple(
                ShardSegment.from_dict(s, where=f"{where} '{name}', segments[{k}]")
                for k, s in enumerate(get_checked(d, "segments", (list, tuple), where))
            )
        return cls(
            get_checked(d, "rank", int, where),
            name,
            get_checked(d, "checksum", str, where),
            get_checked(d, "bytes", int, where),
            segments,
        )
