"""What a whole training checkpoint adds to an optimizer checkpoint: weights, buffers, aliases and side files.

Pure records, no file access. A whole checkpoint is a sharded checkpoint (format 3) whose units carry one more
sharded state key, :data:`~fsdp_optim.core.records.WEIGHTS_KEY` (``"@param"``: the flat parameter's own padded
shard, the fp32 master shard under mixed precision), in the same rank files as the optimizer state, and whose
manifest carries a ``"training"`` section::

    "training": {"version": 1,
                 "buffers": [{"name": "norm.running_mean", "shape": [6], "dtype": "float32"}, ...],
                 "buffers_per_rank": false,        # false: rank 0's side file holds them; true: every rank's
                 "aliases": [["head.weight", "embed.weight"]],   # state_dict() names of tied parameters
                 "files": [{"rank": 0, "file": "train-3f2a9c1b0d4e-rank00000-of-00002.safetensors",
                            "checksum": "xxh3-128:...", "bytes": 5120}, ...],   # one side file per rank
                 "data": {"version": 1, "seed": 0, "epoch": 3, "consumed": 48, ...}}   # only when saved with data=

``"data"``: the job's place in its data stream (:class:`~fsdp_optim.core.data_position.DataPosition`). A side file
(:mod:`.side_file`) holds that rank's ``extra`` (the loop's state) and, on rank 0 or on every rank when they
differ, the model's buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdp_optim.core.data_position import DataPosition
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.records import WEIGHTS_KEY, FlatRecord, get_checked
from fsdp_optim.formats.sharded.file_record import FileRecord

__all__ = ["TRAINING_VERSION", "BufferSpec", "TrainingRecord", "optimizer_flats", "side_file_name", "weights_flats"]

TRAINING_VERSION = 1


def side_file_name(save_id: str, rank: int, world_size: int) -> str:
    return f"train-{save_id[:12]}-rank{rank:05d}-of-{world_size:05d}.safetensors"


@dataclass(frozen=True)
class BufferSpec:
    """One persistent buffer of the unwrapped model (``model.state_dict()`` name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Any, *, where: str) -> BufferSpec:
        name = get_checked(d, "name", str, where)
        shape = tuple(get_checked(d, "shape", (list, tuple), f"{where}, buffer '{name}'"))
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"{where}: buffer '{name}' has shape {shape}, expected non-negative ints")
        dtype = get_checked(d, "dtype", str, f"{where}, buffer '{name}'")
        dtype_from_str(dtype, where=f"{where}, buffer '{name}'")
        return cls(name, shape, dtype)


@dataclass(frozen=True)
class TrainingRecord:
    """The manifest's ``"training"`` section (see the module docstring)."""

    buffers: tuple[BufferSpec, ...]
    buffers_per_rank: bool
    aliases: tuple[tuple[str, str], ...]  # (name in model.state_dict(), name of the parameter it is tied to)
    files: tuple[FileRecord, ...]  # one side file per rank, in rank order
    version: int = TRAINING_VERSION
    data: DataPosition | None = None  # the data stream's position, when saved with data=

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": self.version,
            "buffers": [b.to_dict() for b in self.buffers],
            "buffers_per_rank": self.buffers_per_rank,
            "aliases": [list(a) for a in self.aliases],
            "files": [f.to_dict() for f in self.files],
        }
        return d if self.data is None else {**d, "data": self.data.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, *, where: str) -> TrainingRecord:
        where = f"{where}, training"
        version = get_checked(d, "version", int, where)
        if version != TRAINING_VERSION:
            raise ValueError(f"{where}: version {version!r}, but this fsdp_optim reads {TRAINING_VERSION}")
        aliases = []
        for k, pair in enumerate(get_checked(d, "aliases", (list, tuple), where)):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
                raise ValueError(f"{where}: aliases[{k}] is {pair!r}, expected [state_dict name, parameter name]")
            aliases.append((pair[0], pair[1]))
        return cls(
            buffers=tuple(
                BufferSpec.from_dict(b, where=f"{where}, buffers[{k}]")
                for k, b in enumerate(get_checked(d, "buffers", (list, tuple), where))
            ),
            buffers_per_rank=get_checked(d, "buffers_per_rank", bool, where),
            aliases=tuple(aliases),
            files=tuple(FileRecord.from_dict(f, where=f"{where}, files") for f in get_checked(d, "files", list, where)),
            data=DataPosition.from_dict(d["data"], where=f"{where}, data") if "data" in d else None,
        )

    def check(self, world_size: int, params: Sequence[str], files: Sequence[FileRecord], *, source: str) -> None:
        """Raise ``ValueError`` unless the section fits its manifest (ranks, names, file names)."""
        ranks = [f.rank for f in self.files]
        if ranks != list(range(world_size)):
            raise ValueError(f"{source}: training: expected one side file per rank 0..{world_size - 1}, found {ranks}")
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"{source}: training: a buffer is listed twice ({sorted(names)[:5]}...)")
        known = set(params)
        for alias, target in self.aliases:
            if target not in known or alias in known:
                raise ValueError(
                    f"{source}: training: alias '{alias}' -> '{target}' must name a parameter the checkpoint holds, "
                    "under a name it does not"
                )
        taken = {f.file for f in files}
        clash = next((f.file for f in self.files if f.file in taken), None)
        if clash is not None:
            raise ValueError(f"{source}: training: side file '{clash}' is also listed as a rank file")

    def side_file(self, rank: int) -> FileRecord:
        return self.files[rank]

    def buffer_specs(self) -> Mapping[str, BufferSpec]:
        return {b.name: b for b in self.buffers}


def optimizer_flats(flats: Sequence[FlatRecord]) -> tuple[FlatRecord, ...]:
    """The units as the optimizer sees them: every state key but the weights."""
    return tuple(
        replace(f, state=tuple(e for e in f.state if e.key != WEIGHTS_KEY))
        if any(e.key == WEIGHTS_KEY for e in f.state)
        else f
        for f in flats
    )


def weights_flats(flats: Sequence[FlatRecord]) -> tuple[FlatRecord, ...]:
    """The units as the model sees them: the weights key alone (none for a unit saved without it)."""
    return tuple(replace(f, state=tuple(e for e in f.state if e.key == WEIGHTS_KEY)) for f in flats)
