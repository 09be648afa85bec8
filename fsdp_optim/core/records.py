"""Typed records of optimizer state that the planner reads: a flat parameter with its state entries, a param group.

Rank-free and format-free: every source (full dict, sharded checkpoint, fairseq set) describes itself with these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.core.flatten import StateKind, classify_flat_state, clone_value
from fsdp_optim.core.layout import FlatParamLayout, ParamSpec
from fsdp_optim.core.preconditions import check_world_size

# The state key under which a whole checkpoint keeps each unit's own padded parameter shard, beside the
# optimizer's keys in the same rank files (no optimizer names a state key with "@").
WEIGHTS_KEY = "@param"


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
        kind = get_checked(d, "kind", str, where)
        if kind == StateKind.SHARDED.value:
            dtype = get_checked(d, "dtype", str, where)
            dtype_from_str(dtype, where=f"{where}, state '{d.get('key')}'")
            return cls(get_checked(d, "key", str, where), StateKind.SHARDED, dtype=dtype)
        if kind == StateKind.SCALAR.value:
            if "value" not in d:
                raise ValueError(f"{where}: scalar state entry has no 'value'")
            value = d["value"]
            if torch.is_tensor(value) and value.dim() != 0:
                raise ValueError(
                    f"{where}: scalar state '{d.get('key')}' is a tensor of shape {tuple(value.shape)}, expected a "
                    "0-dim tensor or a number"
                )
            return cls(get_checked(d, "key", str, where), StateKind.SCALAR, value=value)
        raise ValueError(f"{where}: state kind must be 'sharded' or 'scalar', found {kind!r}")



def state_entries(flat: FlatParamLayout, values: Mapping[str, Any]) -> tuple[StateEntry, ...]:
    """The entries describing one flat parameter's shard ``values`` (``{key: padded shard or scalar}``).

    Scalars keep an independent copy of their value. Raises ``NotImplementedError`` for state that is
    neither shard-shaped nor 0-dim (see :func:`~fsdp_optim.core.flatten.classify_flat_state`).
    """
    return tuple(
        StateEntry(key, kind, dtype=dtype_to_str(values[key].dtype))
        if kind is StateKind.SHARDED
        else StateEntry(key, kind, value=clone_value(values[key]))
        for key, kind in classify_flat_state(flat, values).items()
    )



@dataclass(frozen=True)
class FlatRecord(FlatParamLayout):
    """A rank-independent :class:`~fsdp_optim.core.layout.FlatParamLayout` (``rank`` is ``None``) plus its saved
    state."""

    state: tuple[StateEntry, ...] = ()

    def layout(self, rank: int) -> FlatParamLayout:
        """This unit as ``rank`` holds it, without the state entries."""
        return FlatParamLayout(**{f.name: getattr(self, f.name) for f in fields(FlatParamLayout)}).at_rank(rank)

    @classmethod
    def from_layout(cls, flat: FlatParamLayout, state: Sequence[StateEntry] = ()) -> FlatRecord:
        values = {f.name: getattr(flat, f.name) for f in fields(FlatParamLayout)}
        return cls(**{**values, "rank": None}, state=tuple(state))

    def entry(self, key: str) -> StateEntry:
        return next(e for e in self.state if e.key == key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "flattened": self.flattened,
            "dtype": dtype_to_str(self.dtype),
            "world_size": self.world_size,
            "numel": self.numel,
            "per_rank": self.per_rank,
            "params": [
                {"name": p.name, "shape": list(p.shape), "numel": p.numel, "offset": p.offset} for p in self.params
            ],
            "state": [e.to_dict() for e in self.state],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> FlatRecord:
        unit = get_checked(d, "unit", str, where)
        where = f"{where} (unit '{unit or '<root>'}')"
        world_size = get_checked(d, "world_size", int, where)
        check_world_size(f"{where}: world_size", world_size)
        if "padding" in d:  # formats 1 and 2 listed it per rank; it follows from numel and world size
            padding = get_checked(d, "padding", (list, tuple), where)
            if len(padding) != world_size:  # before anything is computed per declared rank
                raise ValueError(
                    f"{where}: 'padding' lists {len(padding)} ranks, expected {world_size} (its world size)"
                )
        record = cls(
            unit=unit,
            params=_param_specs(get_checked(d, "params", (list, tuple), where), where),
            world_size=world_size,
            rank=None,
            dtype=dtype_from_str(get_checked(d, "dtype", str, where), where=where),
            flattened=get_checked(d, "flattened", bool, where),
            # absent in files before MoE support
            per_rank=get_checked({"per_rank": False, **d}, "per_rank", bool, where),
            state=tuple(StateEntry.from_dict(e, where=where) for e in get_checked(d, "state", (list, tuple), where)),
        )
        for key in ("numel", "padding"):
            if key in d:
                expected = record.numel if key == "numel" else record.padding()
                found = list(d[key]) if isinstance(d[key], (list, tuple)) else d[key]
                if found != expected:
                    raise ValueError(
                        f"{where}: '{key}' is {d[key]!r}, expected {expected} from the shapes and world size"
                    )
        return record



def _param_specs(params: Sequence[Any], where: str) -> tuple[ParamSpec, ...]:
    """Checked :class:`ParamSpec` records from their saved dicts; offsets follow from the shapes."""
    specs, offset = [], 0
    for p in params:
        name = get_checked(p, "name", str, where)
        shape = tuple(get_checked(p, "shape", (list, tuple), f"{where}, parameter '{name}'"))
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
        indices = get_checked(d, "flat_indices", (list, tuple), where)
        if not all(isinstance(i, int) for i in indices):
            raise ValueError(f"{where}: 'flat_indices' must be ints, found {indices!r}")
        hyperparams = dict(get_checked(d, "hyperparams", Mapping, where))
        return cls(hyperparams, tuple(indices), get_checked(d, "named", bool, where))



_MISSING = object()


def get_checked(d: Any, key: str, kind: Any, where: str) -> Any:
    if type(d) is dict:  # the common case, without the ABC checks (a manifest calls this ~20 times per unit)
        value = d.get(key, _MISSING)
        if value is not _MISSING and type(value) in (kind if isinstance(kind, tuple) else (kind,)):
            return value
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
