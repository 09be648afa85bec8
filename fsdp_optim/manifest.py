"""Typed, versioned records of a sharded optimizer checkpoint on disk, and their plain-dict form.

Pure: no file access, no ``torch.distributed``. Everything a record turns into is a plain dict of
``str``/``int``/``float``/``bool``/``None``/lists/tuples/tensors, so that ``torch.load(..., weights_only=True)``
reads it back; dtypes are stored as strings (``"float32"``).

A sharded checkpoint directory holds one manifest and one file per rank::

    ckpt/
      manifest.pt                          # written last, atomically: the checkpoint exists once it does
      optim-3f2a9c1b0d4e-rank00000-of-00002.pt
      optim-3f2a9c1b0d4e-rank00001-of-00002.pt

The manifest (``Manifest.to_dict()``, wrapped with a checksum by :func:`wrap`)::

    {"version": 1, "save_id": "3f2a9c1b0d4e...", "optimizer": "Adam", "world_size": 2,
     "param_order": ["embed.weight", ...],             # the unwrapped model's named_parameters() order
     "flat_params": [                                  # FSDP-instance order, as in layout.ModelLayout
        {"unit": "block1", "flattened": True, "dtype": "float32", "world_size": 2, "numel": 91,
         "padding": [0, 1],                             # per rank, derived from numel and world size
         "params": [{"name": "block1.0.weight", "shape": [7, 6], "numel": 42, "offset": 0}, ...],
         "state": [{"key": "exp_avg", "kind": "sharded", "dtype": "float32"},
                   {"key": "step", "kind": "scalar", "value": tensor(3.)}]},
        ...],
     "param_groups": [{"hyperparams": {"lr": 0.01, "betas": (0.9, 0.999), ...}, "flat_indices": [0, 2],
                       "named": False}, ...],
     "files": [{"rank": 0, "file": "optim-...-rank00000-of-00002.pt", "checksum": "sha256:...", "bytes": 4711}]}

A rank file (:func:`shard_payload`)::

    {"fsdp_optim_checkpoint": {"kind": "shard", "version": 1, "save_id": ..., "rank": 0, "world_size": 2,
                               "checksum": "sha256:..."},       # digest of the header and unit_checksums
     "unit_checksums": {flat_index: "sha256:..."},              # digest of state[flat_index]
     "state": {flat_index: {"exp_avg": Tensor[shard_numel], "step": tensor(3.)}}}

Checksums are content digests (:func:`digest`, xxh3-128; SHA-256 in files of earlier versions): tensors
contribute dtype, shape and raw bytes, other values their type and ``repr``. A unit's digest is checked when that unit is read, so a reader that
processes one unit at a time never has to touch a whole file first.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import xxhash

from .flatten import StateKind, classify_flat_state, clone_value
from .layout import FlatParamLayout, ModelLayout, ParamSpec
from .preconditions import check_version, check_world_size
from .untrusted import ALLOWED_DTYPES

__all__ = [
    "CHECKPOINT_VERSION",
    "HEADER_KEY",
    "MANIFEST_NAME",
    "FileRecord",
    "FlatRecord",
    "GroupRecord",
    "Manifest",
    "StateEntry",
    "check_checksum",
    "digest",
    "digest_matches",
    "dtype_from_str",
    "dtype_to_str",
    "shard_file_name",
    "read_header",
    "shard_payload",
    "state_entries",
    "unwrap",
    "wrap",
]

CHECKPOINT_VERSION = 1
HEADER_KEY = "fsdp_optim_checkpoint"
MANIFEST_NAME = "manifest.pt"


def shard_file_name(save_id: str, rank: int, world_size: int) -> str:
    return f"optim-{save_id[:12]}-rank{rank:05d}-of-{world_size:05d}.pt"


# ---------------------------------------------------------------------------------------------------
# dtypes and checksums


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str, *, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype not in ALLOWED_DTYPES:
        raise ValueError(f"{where}: expected the name of a real dtype such as 'float32', found {name!r}")
    return dtype


# Checksums guard against corruption, not forgery (a forger rewrites the stored digest too), so new
# files use xxh3-128 (xxhash: ~12 GB/s on one core here, against ~1.7 GB/s for SHA-256); files written
# with SHA-256 by earlier versions still verify. The prefix of a digest names its algorithm.
DIGEST_ALGORITHM = "xxh3-128"
_HASHES: dict[str, Callable[[], Any]] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def digest(value: Any, algorithm: str = DIGEST_ALGORITHM) -> str:
    """A content digest of a (nested) value: ``"xxh3-128:<hex>"``. Reads tensor bytes without copying them."""
    h = _HASHES[algorithm]()
    _feed(h, value)
    return f"{algorithm}:{h.hexdigest()}"


def digest_matches(value: Any, expected: Any) -> bool:
    """Whether ``expected`` (a stored digest, any supported algorithm) is the digest of ``value``."""
    algorithm = expected.partition(":")[0] if isinstance(expected, str) else None
    return algorithm in _HASHES and digest(value, algorithm) == expected


def _feed(h: Any, value: Any) -> None:
    if torch.is_tensor(value):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h.update(f"T{dtype_to_str(t.dtype)}{tuple(t.shape)}|".encode())
        nbytes = t.numel() * t.element_size()
        if nbytes:
            h.update(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())))
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)}|".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _feed(h, key)
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}{len(value)}|".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__}:{value!r}|".encode())


def wrap(kind: str, body: Any, **header: Any) -> dict[str, Any]:
    """``{HEADER_KEY: {"kind", "version", "checksum", **header}, "body": body}``; the checksum covers both."""
    head = {"kind": kind, "version": CHECKPOINT_VERSION, **header}
    return {HEADER_KEY: {**head, "checksum": digest([head, body])}, "body": body}


def unwrap(obj: Any, kind: str, *, source: str) -> tuple[dict[str, Any], Any]:
    """Check a :func:`wrap` result read from ``source``; return ``(header, body)``."""
    header, checksum = read_header(obj, kind, source=source, covered="body")
    check_checksum(header, checksum, obj["body"], source=source)
    return header, obj["body"]


def read_header(obj: Any, kind: str, *, source: str, covered: str, what: str | None = None) -> tuple[dict[str, Any], Any]:
    """The checked header of a file we wrote (kind and version; not yet the checksum): ``(header, checksum)``.

    ``covered`` is the key whose value the header's checksum covers besides the header itself.
    """
    what = what or f"fsdp_optim {kind} file"
    if not isinstance(obj, Mapping) or not isinstance(obj.get(HEADER_KEY), Mapping) or covered not in obj:
        found = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(f"{source}: expected an {what}, found {found}")
    header = dict(obj[HEADER_KEY])
    if header.get("kind") != kind:
        raise ValueError(f"{source}: expected an {what}, found a {header.get('kind')!r} file")
    check_version(header.get("version"), source, CHECKPOINT_VERSION)
    return header, header.pop("checksum", None)


def check_checksum(header: Mapping[str, Any], checksum: Any, covered: Any, *, source: str) -> None:
    """Refuse a file whose header checksum does not cover its header and ``covered`` value."""
    if not digest_matches([dict(header), covered], checksum):
        raise ValueError(f"{source}: checksum mismatch in the file header (file is corrupt or was modified)")


def shard_payload(
    state: Mapping[int, Mapping[str, Any]], *, save_id: str, rank: int, world_size: int
) -> tuple[dict[str, Any], str]:
    """A rank file's content and its checksum (which the manifest also records)."""
    unit_checksums = {i: digest(entries) for i, entries in state.items()}
    head = {"kind": "shard", "version": CHECKPOINT_VERSION, "save_id": save_id, "rank": rank, "world_size": world_size}
    checksum = digest([head, unit_checksums])
    return {HEADER_KEY: {**head, "checksum": checksum}, "unit_checksums": unit_checksums, "state": dict(state)}, checksum


# ---------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class StateEntry:
    """One optimizer state key of a flat parameter: a sharded tensor (with its dtype) or a shared scalar."""

    key: str
    kind: StateKind
    dtype: str | None = None  # sharded entries only
    value: Any = None  # scalar entries only: a 0-dim tensor or a Python value
    # Sharded entries of a source that knows each parameter's state shape (a full dict); never saved.
    shape: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.kind is StateKind.SHARDED:
            return {"key": self.key, "kind": self.kind.value, "dtype": self.dtype}
        return {"key": self.key, "kind": self.kind.value, "value": self.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> StateEntry:
        kind = _get(d, "kind", str, where)
        if kind == StateKind.SHARDED.value:
            dtype = _get(d, "dtype", str, where)
            dtype_from_str(dtype, where=f"{where}, state '{d.get('key')}'")
            return cls(_get(d, "key", str, where), StateKind.SHARDED, dtype=dtype)
        if kind == StateKind.SCALAR.value:
            if "value" not in d:
                raise ValueError(f"{where}: scalar state entry has no 'value'")
            value = d["value"]
            if torch.is_tensor(value) and value.dim() != 0:
                raise ValueError(
                    f"{where}: scalar state '{d.get('key')}' is a tensor of shape {tuple(value.shape)}, expected a "
                    "0-dim tensor or a number"
                )
            return cls(_get(d, "key", str, where), StateKind.SCALAR, value=value)
        raise ValueError(f"{where}: state kind must be 'sharded' or 'scalar', found {kind!r}")


def state_entries(flat: FlatParamLayout, values: Mapping[str, Any]) -> tuple[StateEntry, ...]:
    """The entries describing one flat parameter's shard ``values`` (``{key: padded shard or scalar}``).

    Scalars keep an independent copy of their value. Raises ``NotImplementedError`` for state that is
    neither shard-shaped nor 0-dim (see :func:`~fsdp_optim.flatten.classify_flat_state`).
    """
    return tuple(
        StateEntry(key, kind, dtype=dtype_to_str(values[key].dtype))
        if kind is StateKind.SHARDED
        else StateEntry(key, kind, value=clone_value(values[key]))
        for key, kind in classify_flat_state(flat, values).items()
    )


@dataclass(frozen=True)
class FlatRecord(FlatParamLayout):
    """A rank-independent :class:`~fsdp_optim.layout.FlatParamLayout` (``rank`` is ``None``) plus its saved state."""

    state: tuple[StateEntry, ...] = ()

    def layout(self, rank: int) -> FlatParamLayout:
        """This unit as ``rank`` holds it, without the state entries."""
        flat = FlatParamLayout(self.unit, self.params, self.world_size, None, self.dtype, self.flattened, self.per_rank)
        return flat.at_rank(rank)

    @classmethod
    def from_layout(cls, flat: FlatParamLayout, state: Sequence[StateEntry] = ()) -> FlatRecord:
        return cls(
            unit=flat.unit,
            params=flat.params,
            world_size=flat.world_size,
            rank=None,
            dtype=flat.dtype,
            flattened=flat.flattened,
            per_rank=flat.per_rank,
            state=tuple(state),
        )

    def entry(self, key: str) -> StateEntry:
        return next(e for e in self.state if e.key == key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "flattened": self.flattened,
            "dtype": dtype_to_str(self.dtype),
            "world_size": self.world_size,
            "numel": self.numel,
            "padding": self.padding(),
            "per_rank": self.per_rank,
            "params": [{"name": p.name, "shape": list(p.shape), "numel": p.numel, "offset": p.offset} for p in self.params],
            "state": [e.to_dict() for e in self.state],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> FlatRecord:
        unit = _get(d, "unit", str, where)
        where = f"{where} (unit '{unit or '<root>'}')"
        world_size = _get(d, "world_size", int, where)
        check_world_size(f"{where}: world_size", world_size)
        padding = _get(d, "padding", (list, tuple), where)
        if len(padding) != world_size:  # before anything is computed per declared rank
            raise ValueError(f"{where}: 'padding' lists {len(padding)} ranks, expected {world_size} (its world size)")
        record = cls(
            unit=unit,
            params=_param_specs(_get(d, "params", (list, tuple), where), where),
            world_size=world_size,
            rank=None,
            dtype=dtype_from_str(_get(d, "dtype", str, where), where=where),
            flattened=_get(d, "flattened", bool, where),
            per_rank=_get({"per_rank": False, **d}, "per_rank", bool, where),  # absent in files before MoE support
            state=tuple(StateEntry.from_dict(e, where=where) for e in _get(d, "state", (list, tuple), where)),
        )
        for key, expected in (("numel", record.numel), ("padding", record.padding())):
            found = d.get(key, expected)
            if (list(found) if isinstance(found, (list, tuple)) else found) != expected:
                raise ValueError(f"{where}: '{key}' is {found!r}, expected {expected} from the shapes and world size")
        return record


def _param_specs(params: Sequence[Any], where: str) -> tuple[ParamSpec, ...]:
    """Checked :class:`ParamSpec` records from their saved dicts; offsets follow from the shapes."""
    specs, offset = [], 0
    for p in params:
        name = _get(p, "name", str, where)
        shape = tuple(_get(p, "shape", (list, tuple), f"{where}, parameter '{name}'"))
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"{where}: parameter '{name}' has shape {shape}, expected non-negative ints")
        if p.get("offset", offset) != offset or p.get("numel", math.prod(shape)) != math.prod(shape):
            raise ValueError(
                f"{where}: parameter '{name}' says offset {p.get('offset')} and numel {p.get('numel')}, "
                f"expected {offset} and {math.prod(shape)} from the shapes before it"
            )
        specs.append(ParamSpec(name, shape, offset))
        offset += math.prod(shape)
    return tuple(specs)


@dataclass(frozen=True)
class GroupRecord:
    """One param group: hyperparameters (everything but ``params``) and its flat parameters, in optimizer order."""

    hyperparams: Mapping[str, Any]
    flat_indices: tuple[int, ...]
    named: bool = False  # the optimizer's group carried "param_names"

    def to_dict(self) -> dict[str, Any]:
        return {"hyperparams": dict(self.hyperparams), "flat_indices": list(self.flat_indices), "named": self.named}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> GroupRecord:
        indices = _get(d, "flat_indices", (list, tuple), where)
        if not all(isinstance(i, int) for i in indices):
            raise ValueError(f"{where}: 'flat_indices' must be ints, found {indices!r}")
        return cls(dict(_get(d, "hyperparams", Mapping, where)), tuple(indices), _get(d, "named", bool, where))


@dataclass(frozen=True)
class FileRecord:
    """One rank file: its name inside the checkpoint directory, checksum and size in bytes."""

    rank: int
    file: str
    checksum: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "checksum": self.checksum, "bytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> FileRecord:
        name = _get(d, "file", str, where)
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ValueError(f"{where}: file name must be a plain name inside the checkpoint directory, found {name!r}")
        return cls(_get(d, "rank", int, where), name, _get(d, "checksum", str, where), _get(d, "bytes", int, where))


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
        return replace(self, world_size=world_size, flat_params=flats, files=())

    def state_bytes(self) -> int:
        """Bytes of sharded state, padding excluded (what a full dict holds)."""
        total = 0
        for flat in self.flat_params:
            for e in flat.state:
                if e.kind is StateKind.SHARDED:
                    total += flat.numel * dtype_from_str(e.dtype, where="state").itemsize  # type: ignore[arg-type]
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "save_id": self.save_id,
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "param_order": list(self.param_order),
            "flat_params": [f.to_dict() for f in self.flat_params],
            "param_groups": [g.to_dict() for g in self.groups],
            "files": [f.to_dict() for f in self.files],
        }

    @classmethod
    def from_dict(cls, d: Any, *, source: str) -> Manifest:
        """Parse and check a manifest read from ``source`` (named in every error)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{source}: expected a manifest dict, found {type(d).__name__}")
        check_version(d.get("version"), source, CHECKPOINT_VERSION)
        optimizer = d.get("optimizer")
        if optimizer is not None and not isinstance(optimizer, str):
            raise ValueError(f"{source}: 'optimizer' must be a class name or None, found {optimizer!r}")
        flats = tuple(
            FlatRecord.from_dict(f, where=f"{source}, flat_params[{i}]")
            for i, f in enumerate(_get(d, "flat_params", (list, tuple), source))
        )
        groups = tuple(
            GroupRecord.from_dict(g, where=f"{source}, param_groups[{k}]")
            for k, g in enumerate(_get(d, "param_groups", (list, tuple), source))
        )
        files = tuple(FileRecord.from_dict(f, where=f"{source}, files") for f in _get(d, "files", (list, tuple), source))
        manifest = cls(
            save_id=_get(d, "save_id", str, source),
            optimizer=optimizer,
            world_size=_get(d, "world_size", int, source),
            param_order=tuple(_get(d, "param_order", (list, tuple), source)),
            flat_params=flats,
            groups=groups,
            files=files,
            version=d["version"],
        )
        manifest.check(source=source)
        return manifest

    def check(self, *, source: str) -> None:
        """Raise ``ValueError`` unless the records are consistent with each other."""
        check_world_size(f"{source}: world_size", self.world_size)
        names = [p.name for f in self.flat_params for p in f.params]
        if sorted(names) != sorted(self.param_order) or len(set(names)) != len(names):
            extra = sorted(set(names) ^ set(self.param_order)) or [n for n in names if names.count(n) > 1]
            raise ValueError(
                f"{source}: 'param_order' and the units' parameters disagree (e.g. '{extra[0]}'); each parameter "
                "must appear once in both"
            )
        for i, flat in enumerate(self.flat_params):
            if flat.per_rank and (flat.world_size != 1 or self.world_size == 1):
                raise ValueError(f"{source}: unit '{flat.unit}' is per-rank, which needs world size 1 inside a larger world")
            if flat.world_size not in (1, self.world_size):
                raise ValueError(
                    f"{source}: unit '{flat.unit}' is sharded over {flat.world_size} ranks, expected 1 or {self.world_size}"
                )
            if len({e.key for e in flat.state}) != len(flat.state):
                raise ValueError(f"{source}: unit '{flat.unit}' (flat_params[{i}]) lists a state key twice")
        seen: set[int] = set()
        for k, group in enumerate(self.groups):
            for i in group.flat_indices:
                if not 0 <= i < len(self.flat_params) or i in seen:
                    raise ValueError(
                        f"{source}: param group {k} lists flat parameter {i}; expected each of 0..{len(self.flat_params) - 1} "
                        "at most once over all groups"
                    )
                seen.add(i)
        for i, flat in enumerate(self.flat_params):
            if flat.state and i not in seen:
                raise ValueError(f"{source}: unit '{flat.unit}' has optimizer state but is in no param group")
        if self.files:
            ranks = sorted(f.rank for f in self.files)
            if ranks != list(range(self.world_size)):
                raise ValueError(f"{source}: expected one file per rank 0..{self.world_size - 1}, found ranks {ranks}")


def _get(d: Any, key: str, kind: Any, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: expected a dict, found {type(d).__name__}")
    if key not in d:
        raise ValueError(f"{where}: missing '{key}' (found keys {sorted(map(str, d))})")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
        raise ValueError(f"{where}: '{key}' must be {expected}, found {type(value).__name__} {value!r}")
    return value
