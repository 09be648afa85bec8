"""Writing our sharded checkpoint: rank files, then the manifest last (the commit point), through the one way
out (:mod:`fsdp_optim.disk.local_directory`). :data:`CHECKPOINT` tells that writer what a checkpoint directory owns:

    ckpt/manifest.json                   # ours when it reads as our manifest (format 1: manifest.pt)
    ckpt/optim-<save id 12 hex>-rank00000-of-00002.safetensors   # ours when that manifest lists it (format 1: .pt)
    ckpt/train-<save id 12 hex>-rank00000-of-00002.safetensors   # a whole checkpoint's side files: the same
    ckpt/anything else                             # foreign: refused without overwrite, never deleted
    (a manifest.json that does not read as ours: refused even with overwrite, since our commit would replace it)

A write is journaled as ``{"save_id": 32 hex, "world_size": W, "replaces": [...], "staging": name}``: from the
save id and world size the next writer knows, by name, every file a killed write can have left.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.limits import MAX_WORLD_SIZE
from fsdp_optim.disk.atomic import atomic_write, new_save_id
from fsdp_optim.disk.byte_io import ByteIO, read_all
from fsdp_optim.disk.errors import StoreUnavailable
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.local_directory import staged_output
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.locks import remove_recorded
from fsdp_optim.disk.save import SaveRules, Survey
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.locate import manifest_file, read_manifest
from fsdp_optim.formats.sharded.manifest import (
    LEGACY_MANIFEST_NAME,
    MANIFEST_NAME,
    MANIFEST_NAMES,
    Manifest,
    shard_file_name,
)
from fsdp_optim.formats.sharded.manifest_json import MAX_MANIFEST_BYTES, manifest_from_json, manifest_to_json
from fsdp_optim.formats.sharded.ranged import rank_layout, shard_metadata, write_rank
from fsdp_optim.formats.sharded.rank_file import Pieces, host_pieces
from fsdp_optim.formats.sharded.segments import plan_segments
from fsdp_optim.formats.sharded.training import side_file_name

__all__ = [
    "CHECKPOINT",
    "RankParts",
    "save_rules",
    "write_all_or_nothing",
    "write_manifest",
    "write_shard_file",
]

# Rank files of every format; a JSON-manifest commit also removes a format-1 checkpoint's manifest.pt.
# Side files of a whole checkpoint (train-...) are the same kind: per save id and rank, listed by the manifest.
_SHARD_FILE = re.compile(
    r"^(optim-[0-9a-f]+-rank\d+-of-\d+\.(pt|safetensors)"
    r"|train-[0-9a-f]+-rank\d+-of-\d+\.safetensors)$"
)
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")


class _CheckpointClaims:
    """What a sharded checkpoint directory owns (see the module docstring)."""

    def survey(self, directory: Path) -> Survey:
        # manifest.json (or manifest.pt, format 1) and the rank files it lists are ours; a manifest.pt beside a
        # manifest.json (a JSON-manifest commit over format 1, killed before removing it) is ours too, with its files.
        names = set(os.listdir(directory))
        files: set[str] = set()
        problems: list[str] = []
        refused: str | None = None
        for manifest in (n for n in MANIFEST_NAMES if n in names):
            try:
                listed = read_manifest(directory / manifest).file_names()
                files |= listed | ({manifest} if manifest == LEGACY_MANIFEST_NAME else set())
            except (ValueError, OSError) as exc:
                problem = f"its {manifest} is not an fsdp_optim manifest ({exc})"
                refused = problem if manifest == MANIFEST_NAME else refused
                problems.append(problem)
        known = frozenset(files | set(MANIFEST_NAMES))
        if refused:  # our commit renames its manifest.json over this one: that would delete it
            why = "the commit would replace it, so it is refused even with overwrite (move or delete it yourself)"
            return Survey(known=known, refused=f"{refused}; {why}")
        if problems:
            return Survey(known=frozenset(names & set(MANIFEST_NAMES)), problem="; ".join(problems))
        stale = leftovers(directory, names - files)  # an interrupted save's files: ours, and obsolete
        return Survey(replaces=frozenset(files), known=known | stale, stale=frozenset(stale))

    def created(self, entry: JournalEntry) -> set[str]:
        save_id, world_size = _journaled(entry)
        if save_id is None or world_size is None:
            return set()
        names = {shard_file_name(save_id, r, world_size, version=v) for r in range(world_size) for v in (1, 2)}
        return names | {side_file_name(save_id, r, world_size) for r in range(world_size)}

    def tagged(self, entry: JournalEntry) -> set[tuple[str, str]]:
        save_id, _ = _journaled(entry)
        return set() if save_id is None else {(name, save_id[:12]) for name in MANIFEST_NAMES}

    def referenced(self, directory: Path) -> set[str] | None:
        manifest = manifest_file(directory)
        if manifest is None:
            return set()
        try:
            return {manifest.name} | read_manifest(manifest).file_names()
        except (ValueError, OSError):
            return None

    def deletable(self, name: str) -> bool:
        return _SHARD_FILE.match(name) is not None or name == LEGACY_MANIFEST_NAME


CHECKPOINT = _CheckpointClaims()
_NAMED_ID = re.compile(r"^(?:optim|train)-(?P<id>[0-9a-f]{12})-rank(?P<rank>\d+)-of-(?P<world>\d+)\.safetensors$")
_MAX_LEFTOVER_HEADER = 1 << 26


def leftovers(directory: Path | Location, names: Iterable[str]) -> set[str]:
    """Of ``names`` (files in ``directory`` that its manifest does not list), those an interrupted save of ours left:
    a rank or side file (format 3) by its name, whose safetensors header says it is ours, with the save id, rank and
    world size its name gives. (A save interrupted on one rank after rank 0 cleaned up leaves files no journal
    names any more; a Ctrl-C to the process group does that.) Unreadable or foreign files (a symlink: no object of
    its own) are not ours."""
    place = where(directory)
    found = set()
    for name in names:
        match = _NAMED_ID.match(name)
        if match is None:
            continue
        meta = _header_metadata(place, name)
        if (
            meta.get("format") == "fsdp_optim"
            and meta.get("save_id", "")[:12] == match["id"]
            and meta.get("rank") == str(int(match["rank"]))
            and meta.get("world_size") == str(int(match["world"]))
        ):
            found.add(name)
    return found


def _header_metadata(place: Location, name: str) -> dict[str, Any]:
    """Object ``name``'s safetensors ``__metadata__``, or ``{}`` where it cannot be read as one."""
    try:
        if place.size(name) is None:  # missing, or no object of its own (a symlink, a directory)
            return {}
        size = int.from_bytes(place.read_range(name, 0, 8), "little")
        if not 2 <= size <= _MAX_LEFTOVER_HEADER:
            return {}
        header = json.loads(bytes(place.read_range(name, 8, 8 + size)))
    except StoreUnavailable:
        raise  # the store did not answer: nothing is known of the object
    except (OSError, ValueError):
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _journaled(entry: JournalEntry) -> tuple[str | None, int | None]:
    """The save id and world size a journal entry announces, if both are well formed (a journal is a file)."""
    sid, world_size = entry.save_id, entry.world_size
    if not (sid is not None and _SAVE_ID.match(sid)):
        return None, None
    if not (world_size is not None and 0 < world_size <= MAX_WORLD_SIZE):
        return None, None
    return sid, world_size


@dataclass(frozen=True)
class RankParts:
    """A rank's tensors as its file holds them: tensor ``name`` is the concatenation of ``parts[name]`` (1-D, in
    ``segments.file_layout`` order, ``sizes[name]`` elements in all; a part may be made only when the writer asks
    for it, as :func:`~.streamed.streamed_parts` does)."""

    parts: Mapping[str, Sequence[torch.Tensor]]
    sizes: Mapping[str, int]

    @classmethod
    def of_state(cls, state: Mapping[int, Mapping[str, Any]]) -> RankParts:
        """``state`` (``{flat: {key: padded 1-D shard or scalar}}``; scalars are the manifest's), laid out."""
        tensors, sizes = plan_segments(state)
        return cls({name: [v for _, _, v in found] for name, found in tensors.items()}, sizes)

    @classmethod
    def of_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> RankParts:
        """Shards already laid out as the file holds them: ``{dtype name: 1-D tensor}`` (what a block re-cut builds)."""
        return cls({k: [v] for k, v in tensors.items()}, {k: v.numel() for k, v in tensors.items()})


def write_shard_file(
    directory: Path, source: Mapping[int, Mapping[str, Any]] | RankParts, *, save_id: str, rank: int,
    world_size: int, durable: bool = True, staged: bool = False, pieces: Pieces = host_pieces,
) -> FileRecord:  # fmt: skip
    """Write one rank's file (a safetensors file, :func:`~.ranged.write_rank`); its record for the manifest.

    ``source``: the rank's state ``{flat: {key: padded 1-D shard or scalar}}`` (a job's save), or its
    :class:`RankParts` (an offline block re-cut, a re-cut streamed one shard at a time). Written atomically beside
    the checkpoint's files, or ``staged`` into a staging directory (created there and fsynced; the commit moves it
    in). ``durable=False``: no fsync (a file staged for an upload). ``pieces``: how the shards' bytes reach the host
    (:data:`~.rank_file.Pieces`; a job's device-to-host stager for shards on a GPU)."""
    content = source if isinstance(source, RankParts) else RankParts.of_state(source)
    name = shard_file_name(save_id, rank, world_size)
    layout = rank_layout(shard_metadata(save_id, rank, world_size), content.sizes, name=name, rank=rank)
    write = lambda file: write_rank(file, layout, content.parts, pieces=pieces)  # noqa: E731
    path = directory / name
    size, checksum = atomic_write(path, write, durable=durable or staged, in_place=staged)
    return FileRecord(rank, name, checksum, size)


def write_manifest(directory: Path, manifest: Manifest, *, replaces: Iterable[str] = ()) -> Path:
    """Commit a checkpoint: write its manifest atomically (last), then remove the rank files of the
    checkpoint it replaces (``replaces``: the previous manifest's files)."""
    path = directory / MANIFEST_NAME
    data = manifest_to_json(manifest)  # before anything is written: a value JSON cannot hold is refused here
    atomic_write(path, lambda file: file.write(data), tag=manifest.save_id[:12])
    remove_recorded(directory, replaces, CHECKPOINT, keep=manifest.file_names())
    return path


def save_rules(save_id: str = "", world_size: int = 0) -> SaveRules:
    """What a checkpoint save tells the :class:`~fsdp_optim.disk.location.Location` it writes to: these claims, the
    journal entry (by the save id and world size a killed save's files are known), the manifest as the commit point
    and what the committed manifest there lists (replaced by the commit). A store journals nothing: it needs neither
    the save id nor the world size."""

    def listed(location: ByteIO, size: int | None = None) -> frozenset[str]:
        data = read_all(location, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES, size=size)
        return frozenset(manifest_from_json(data, source=f"{location}/{MANIFEST_NAME}").file_names())

    entry = JournalEntry(save_id=save_id, world_size=world_size)
    return SaveRules(CHECKPOINT, entry, MANIFEST_NAME, frozenset(MANIFEST_NAMES), listed)


def write_all_or_nothing(
    out: str | os.PathLike[str],
    write: Callable[[Path], Manifest],
    *,
    save_id: str | None = None,
    world_size: int | None = None,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
    replace: bool = True,
) -> Path:
    """Have ``write`` put every rank file into the staging directory and return the manifest; then the files
    move into ``out`` and the manifest is committed there, last (through the one save driver:
    :func:`fsdp_optim.disk.local_directory.staged_output`).
    ``save_id`` and ``world_size`` are the manifest's: by them a killed write's files are journaled."""
    entry = JournalEntry(save_id=save_id or new_save_id(), world_size=world_size or 1)
    with staged_output(out, CHECKPOINT, purpose="reshard", inputs=inputs, overwrite=overwrite, replace=replace,
                       entry=entry, commit_name=MANIFEST_NAME) as stage:  # fmt: skip
        stage.commit = manifest_to_json(write(stage.dir))  # (before anything moves: a value JSON cannot hold, refused)
    return Path(out) / MANIFEST_NAME
