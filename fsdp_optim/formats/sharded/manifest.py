"""Typed, versioned records of a sharded optimizer checkpoint on disk, and their plain-dict form.

Pure: no file access, no ``torch.distributed``. Everything a record turns into is a plain dict of
``str``/``int``/``float``/``bool``/``None``/lists/tuples/tensors, so that ``torch.load(..., weights_only=True)``
reads it back; dtypes are stored as strings (``"float32"``).

A sharded checkpoint directory holds one manifest and one file per rank. Format 3 (written since this
version; no pickle anywhere)::

    ckpt/
      manifest.json                                  # written last, atomically: the checkpoint exists once it does
      optim-3f2a9c1b0d4e-rank00000-of-00002.safetensors
      optim-3f2a9c1b0d4e-rank00001-of-00002.safetensors

``manifest.json`` is ``{"fsdp_optim_checkpoint": {"kind": "manifest", "version": 3, "checksum": ...},
"body": Manifest.to_dict()}`` in exact JSON (:mod:`.json_values`: tuples, tensors and non-finite floats
tagged, so every value reads back with its type and bits), the checksum covering the body's canonical
JSON text. Its size grows with units + parameters + ranks, never with units x ranks: nothing in it is
per (unit, rank). A rank file is a safetensors file (:mod:`.rank_file`) whose header's digest is the
file's ``"checksum"``; where each shard lies in it follows from the units (:mod:`.segments`), and its
chunk checksums are in its own header. Scalar states (``step``, ...) live in the manifest only: they are
tiny, shared by every rank (a save checks that the ranks agree), and exact in JSON, where a 0-dim tensor
per unit per rank would grow every rank file's header and duplicate them.

Format 2 (the same files; its manifest lists, per rank file, ``"segments"`` with their chunk checksums,
and per unit ``"padding"`` per rank) and format 1 (``manifest.pt`` and ``optim-...-rankNNNNN-of-NNNNN.pt``
torch files, :mod:`.torch_files`) stay readable; a directory holding both manifests is read through
``manifest.json`` (a save over a format-1 checkpoint removes ``manifest.pt`` after its commit).

The manifest (``Manifest.to_dict()``; format 1 wrapped with a checksum by
:func:`~fsdp_optim.formats.sharded.torch_files.unwrap`)::

    {"version": 3, "save_id": "3f2a9c1b0d4e...", "optimizer": "Adam", "world_size": 2,
     "param_order": ["embed.weight", ...],             # the unwrapped model's named_parameters() order
     "flat_params": [                                  # FSDP-instance order, as in layout.ModelLayout
        {"unit": "block1", "flattened": True, "dtype": "float32", "world_size": 2, "numel": 91,
         "per_rank": False,                             # formats 1, 2: "padding": [0, 1], per rank
         "params": [{"name": "block1.0.weight", "shape": [7, 6], "numel": 42, "offset": 0}, ...],
         "state": [{"key": "exp_avg", "kind": "sharded", "dtype": "float32"},
                   {"key": "step", "kind": "scalar", "value": tensor(3.)}]},
        ...],
     "param_groups": [{"hyperparams": {"lr": 0.01, "betas": (0.9, 0.999), ...}, "flat_indices": [0, 2],
                       "named": False}, ...],
     "files": [{"rank": 0, "file": "optim-...-rank00000-of-00002.safetensors", "checksum": "xxh3-128:...",
                "bytes": 4711}],
     "chunk_bytes": 65536}                             # formats 2, 3

Checksums are content digests (:func:`fsdp_optim.core.checksums.digest`, xxh3-128; SHA-256 in files of earlier
versions): tensors contribute dtype, shape and raw bytes, other values their type and ``repr``. A unit's digest is
checked when that unit is read, so a reader that processes one unit at a time never has to touch a whole file first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.preconditions import check_version, check_world_size
from fsdp_optim.core.records import WEIGHTS_KEY, FlatRecord, GroupRecord, StateEntry, get_checked
from fsdp_optim.core.source import Reader, Source
from fsdp_optim.formats.sharded.file_record import CHECKPOINT_VERSION, FileRecord
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES
from fsdp_optim.formats.sharded.training import TrainingRecord

__all__ = [
    "LEGACY_MANIFEST_NAME",
    "MANIFEST_NAME",
    "MANIFEST_NAMES",
    "Manifest",
    "shard_file_name",
]

MANIFEST_NAME = "manifest.json"
LEGACY_MANIFEST_NAME = "manifest.pt"
MANIFEST_NAMES = (MANIFEST_NAME, LEGACY_MANIFEST_NAME)  # in order of precedence


def shard_file_name(save_id: str, rank: int, world_size: int, *, version: int = CHECKPOINT_VERSION) -> str:
    suffix = "safetensors" if version >= 2 else "pt"
    return f"optim-{save_id[:12]}-rank{rank:05d}-of-{world_size:05d}.{suffix}"


# ---------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Manifest:
    """Everything needed to rebuild the full optimizer state, or any rank's shard, without the model."""

    save_id: str
    optimizer: str | None
    world_size: int
    param_order: tuple[str, ...]
    flat_params: tuple[FlatRecord, ...]
    groups: tuple[GroupRecord, ...]
    files: tuple[FileRecord, ...] = ()
    version: int = CHECKPOINT_VERSION
    chunk_bytes: int = CHUNK_BYTES  # format 2: bytes per chunk checksum of the rank files' segments
    training: TrainingRecord | None = None  # a whole checkpoint's weights, buffers and side files (.training)

    @classmethod
    def from_layout(
        cls,
        layout: ModelLayout,
        *,
        save_id: str,
        optimizer: str | None = None,
        state: Mapping[int, Sequence[StateEntry]] | None = None,
        groups: Sequence[GroupRecord] = (),
        files: Sequence[FileRecord] = (),
    ) -> Manifest:
        """A manifest for ``layout``; ``state[i]`` lists flat parameter ``i``'s entries (none by default)."""
        state = state or {}
        flats = tuple(FlatRecord.from_layout(f, state.get(i, ())) for i, f in enumerate(layout.flat_params))
        return cls(save_id, optimizer, layout.world_size, layout.param_order, flats, tuple(groups), tuple(files))

    def layout(self, rank: int = 0) -> ModelLayout:
        """The :class:`ModelLayout` this checkpoint was saved from, as seen by ``rank``."""
        return ModelLayout(tuple(f.layout(rank) for f in self.flat_params), self.param_order, self.world_size, rank)

    def with_world_size(self, world_size: int) -> Manifest:
        """The same units re-cut over ``world_size`` ranks (units that were not sharded stay so); no files."""
        # At world size 1 nothing is sharded, so every unit is taken to be shardable.
        flats = tuple(
            replace(f, world_size=world_size) if f.world_size > 1 or self.world_size == 1 else f
            for f in self.flat_params
        )
        # A new checkpoint's description: written in the current format whatever this one was read from.
        return replace(
            self,
            world_size=world_size,
            flat_params=flats,
            files=(),
            training=None,  # side files are per rank: a re-cut whole checkpoint writes its own
            version=CHECKPOINT_VERSION,
            chunk_bytes=CHUNK_BYTES,
        )

    def state_bytes(self) -> int:
        """Bytes of sharded state, padding excluded (what a full dict holds)."""
        total = 0
        for flat in self.flat_params:
            for e in flat.state:
                if e.kind is StateKind.SHARDED:
                    total += flat.numel * dtype_from_str(e.dtype, where="state").itemsize
        return total

    def to_dict(self) -> dict[str, Any]:
        d = {
            "version": self.version,
            "save_id": self.save_id,
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "param_order": list(self.param_order),
            "flat_params": [f.to_dict() for f in self.flat_params],
            "param_groups": [g.to_dict() for g in self.groups],
            "files": [f.to_dict(self.version) for f in self.files],
        }
        d = {**d, "chunk_bytes": self.chunk_bytes} if self.version >= 2 else d
        return d if self.training is None else {**d, "training": self.training.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, *, source: str) -> Manifest:
        """Parse and check a manifest read from ``source`` (named in every error)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: expected a manifest dict, found {type(d).__name__}")
        check_version(d.get("version"), source, CHECKPOINT_VERSION)
        version = d["version"]
        chunk_bytes = get_checked(d, "chunk_bytes", int, source) if version >= 2 else CHUNK_BYTES
        if not 1 <= chunk_bytes <= 1 << 40:
            raise ValueError(f"{source}: 'chunk_bytes' is {chunk_bytes}, expected a positive number of bytes")
        optimizer = d.get("optimizer")
        if optimizer is not None and not isinstance(optimizer, str):
            raise ValueError(f"{source}: 'optimizer' must be a class name or None, found {optimizer!r}")
        flats = tuple(
            FlatRecord.from_dict(f, where=f"{source}, flat_params[{i}]")
            for i, f in enumerate(get_checked(d, "flat_params", (list, tuple), source))
        )
        groups = tuple(
            GroupRecord.from_dict(g, where=f"{source}, param_groups[{k}]")
            for k, g in enumerate(get_checked(d, "param_groups", (list, tuple), source))
        )
        files = tuple(
            FileRecord.from_dict(f, where=f"{source}, files", version=version)
            for f in get_checked(d, "files", (list, tuple), source)
        )
        manifest = cls(
            save_id=get_checked(d, "save_id", str, source),
            optimizer=optimizer,
            world_size=get_checked(d, "world_size", int, source),
            param_order=tuple(get_checked(d, "param_order", (list, tuple), source)),
            flat_params=flats,
            groups=groups,
            files=files,
            version=version,
            chunk_bytes=chunk_bytes,
            training=TrainingRecord.from_dict(d["training"], where=source) if "training" in d else None,
        )
        manifest.check(source=source)
        return manifest

    def check(self, *, source: str) -> None:
        """Raise ``ValueError`` unless the records are consistent with each other."""
        check_world_size(f"{source}: world_size", self.world_size)
        names = [p.name for f in self.flat_params for p in f.params]
        wrong = next((n for n in self.param_order if not isinstance(n, str)), None)
        if wrong is not None:
            raise ValueError(
                f"{source}: 'param_order' holds {repr(wrong)[:80]}, a {type(wrong).__name__}; expected parameter names "
                "(strings), as the model's named_parameters() gives them"
            )
        if sorted(names) != sorted(self.param_order) or len(set(names)) != len(names):
            extra = sorted(set(names) ^ set(self.param_order)) or [n for n in names if names.count(n) > 1]
            raise ValueError(
                f"{source}: 'param_order' and the units' parameters disagree (e.g. '{extra[0]}'); each parameter "
                "must appear once in both"
            )
        for i, flat in enumerate(self.flat_params):
            if flat.per_rank and (flat.world_size != 1 or self.world_size == 1):
                raise ValueError(
                    f"{source}: unit '{flat.unit}' is per-rank, which needs world size 1 inside a larger world"
                )
            if flat.world_size not in (1, self.world_size):
                raise ValueError(
                    f"{source}: unit '{flat.unit}' is sharded over {flat.world_size} ranks, expected 1 or "
                    f"{self.world_size}"
                )
            if len({e.key for e in flat.state}) != len(flat.state):
                raise ValueError(f"{source}: unit '{flat.unit}' (flat_params[{i}]) lists a state key twice")
        seen: set[int] = set()
        for k, group in enumerate(self.groups):
            for i in group.flat_indices:
                if not 0 <= i < len(self.flat_params) or i in seen:
                    raise ValueError(
                        f"{source}: param group {k} lists flat parameter {i}; expected each of "
                        f"0..{len(self.flat_params) - 1} "
                        "at most once over all groups"
                    )
                seen.add(i)
        for i, flat in enumerate(self.flat_params):
            if any(e.key != WEIGHTS_KEY for e in flat.state) and i not in seen:
                raise ValueError(f"{source}: unit '{flat.unit}' has optimizer state but is in no param group")
        if self.files:
            ranks = sorted(f.rank for f in self.files)
            if ranks != list(range(self.world_size)):
                raise ValueError(f"{source}: expected one file per rank 0..{self.world_size - 1}, found ranks {ranks}")
        if self.training is not None:
            self.training.check(self.world_size, names, self.files, source=source)

    def file_names(self) -> set[str]:
        """Every file the checkpoint lists: rank files and, in a whole checkpoint, its side files."""
        side = self.training.files if self.training is not None else ()
        return {f.file for f in (*self.files, *side)}


def manifest_source(
    manifest: Manifest,
    label: str,
    read: Reader,
    rank_reader: Callable[[int], Reader] | None = None,
) -> Source:
    """A checkpoint's records (its manifest) as a planning source; ``read`` reads its rank files."""
    return Source(
        label,
        manifest.optimizer,
        manifest.flat_params,
        manifest.groups,
        read,
        manifest.world_size,
        rank_reader=rank_reader,
    )
