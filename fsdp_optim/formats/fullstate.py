"""The full, world-size-independent optimizer state dict: building it and cutting it back into a shard.

Pure: works on tensors, records and plain dicts; never touches ``torch.distributed``.

A full dict is exactly what ``optim.state_dict()`` returns for a plain torch optimizer of the same class
over the *unwrapped* model, plus two extra keys that ``Optimizer.load_state_dict`` ignores::

    {
        "state": {                       # only parameters that have state
            0: {"step": tensor(3.), "exp_avg": Tensor[8, 4], "exp_avg_sq": Tensor[8, 4]},
            1: {...},
        },
        "param_groups": [                # groups in optimizer order; ids follow named_parameters() order
            {"lr": 0.001, "betas": (0.9, 0.999), ..., "params": [0, 1, 2]},
        ],
        "param_names": {0: "encoder.weight", 1: "encoder.bias", 2: "head.weight"},
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 4, "scalar_keys": ["step"]},
    }

Parameter ids are numbered as torch numbers them: groups in order, each group's parameters in the
unwrapped module's ``named_parameters()`` order, tied parameters once.

A model with *per-rank* units (FSDP units over a process group of one rank inside a larger world, as
mixture-of-experts models put their experts) has different values for the same names on every rank.
Their ids are numbered like the others, but their state is kept for every rank, not in ``"state"``::

        "per_rank_state": {0: {5: {"step": tensor(3.), "exp_avg": Tensor[12, 23], ...}}, 1: {5: {...}}},
        "fsdp_optim": {..., "world_size": 2, "per_rank_units": ["moe.expert"]},

Such a dict loads at its own world size only (rank r gets rank r's experts). ``Optimizer.load_state_dict``
ignores the section, so one process without FSDP cannot resume the experts from it. Scalar states of a
per-rank unit (``step``) must be equal on every rank, as the gather checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.flatten import StateKind, clone_value, same_scalar, show_value, split
from fsdp_optim.core.layout import ModelLayout, ParamSpec
from fsdp_optim.core.preconditions import check_full_dict, check_version
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.source import Reader, Source, plan_error
from fsdp_optim.disk.objects import check_state_dict

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "build_full_state",
    "full_dict_source",
    "param_record",
    "read_meta",
]

FORMAT_KEY = "fsdp_optim"
FORMAT_VERSION = 1
PER_RANK_KEY = "per_rank_state"  # rank -> {id: entries} of per-rank units (MoE experts); absent without them
# 0-dim states that torch's optimizers keep per parameter; used to read full dicts made without fsdp_optim.
KNOWN_SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})
FULL_DICT = "the full dict"  # how a full dict in memory is named in errors


def build_full_state(
    layout: ModelLayout,
    groups: Sequence[GroupRecord],
    flat_states: Mapping[int, Mapping[str, Any]],
    *,
    optimizer: str | None,
    per_rank: Mapping[int, Mapping[int, Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The full dict from each flat parameter's full state: ``flat_states[i]`` ``{key: flat full tensor (1-D,
    padding dropped) or scalar}``; ``per_rank[r]`` the same for rank ``r``'s per-rank flats (MoE experts). Flat
    tensors are split into views (sharing their storage); scalars are cloned per parameter (no two share a ``step``).
    """
    names, out_groups, slots = _number(layout, groups)
    scalar_keys: set[str] = set()
    meta: dict[str, Any] = {"version": FORMAT_VERSION, "optimizer": optimizer, "world_size": layout.world_size}
    full = {"state": _place(layout, slots, flat_states, scalar_keys), "param_groups": out_groups, "param_names": names}
    if per_rank:
        full[PER_RANK_KEY] = {r: _place(layout, slots, states, scalar_keys) for r, states in sorted(per_rank.items())}
        meta["per_rank_units"] = layout.per_rank_units()
    meta["scalar_keys"] = sorted(scalar_keys)
    full[FORMAT_KEY] = meta
    return full


def _number(
    layout: ModelLayout, groups: Sequence[GroupRecord]
) -> tuple[dict[int, str], list[dict[str, Any]], dict[int, tuple[int, int]]]:
    """Ids as torch numbers them: groups in order, each group's parameters in unwrapped-model order.

    Returns ``(param_names, param_groups, slots)`` with ``slots[id] = (flat index, position in flat)``.
    """
    order = layout.order_index()
    names: dict[int, str] = {}
    slots: dict[int, tuple[int, int]] = {}
    out_groups = []
    for group in groups:
        members = sorted(
            ((spec.name, i, p) for i in group.flat_indices for p, spec in enumerate(layout.flat_params[i].params)),
            key=lambda m: order[m[0]],
        )
        ids = []
        for name, flat_index, position in members:
            pid = len(names)
            names[pid], slots[pid] = name, (flat_index, position)
            ids.append(pid)
        out_group = {k: clone_value(v) for k, v in group.hyperparams.items()}
        out_group["params"] = ids
        if group.named:
            out_group["param_names"] = [names[i] for i in ids]
        out_groups.append(out_group)
    return names, out_groups, slots


def _place(
    layout: ModelLayout,
    slots: Mapping[int, tuple[int, int]],
    flat_states: Mapping[int, Mapping[str, Any]],
    scalar_keys: set[str],
) -> dict[int, dict[str, Any]]:
    """``{id: {key: view of the flat tensor shaped like the parameter, or a cloned scalar}}``."""
    splits: dict[int, dict[str, list[torch.Tensor]]] = {}
    state: dict[int, dict[str, Any]] = {}
    for pid, (flat_index, position) in slots.items():
        flat_state = flat_states.get(flat_index)
        if not flat_state:
            continue
        if flat_index not in splits:
            flat = layout.flat_params[flat_index]
            # Scalars are 0-dim tensors or Python values, so any 1-D tensor here is a flat full tensor.
            splits[flat_index] = {
                k: split(flat, v) for k, v in flat_state.items() if torch.is_tensor(v) and v.dim() == 1
            }
        state[pid] = {
            key: splits[flat_index][key][position] if key in splits[flat_index] else clone_value(value)
            for key, value in flat_state.items()
        }
        scalar_keys.update(key for key in flat_state if key not in splits[flat_index])
    return state


# ---------------------------------------------------------------------------------------------------
# Reading a full dict: its header, and the dict as a planning source


def read_meta(full: Mapping[str, Any], where: str = FULL_DICT) -> Mapping[str, Any] | None:
    """The ``"fsdp_optim"`` block of a full dict (``None`` for a plain optimizer's dict), checked."""
    meta = full.get(FORMAT_KEY)
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise TypeError(f"{where}: '{FORMAT_KEY}' must be a dict, found {type(meta).__name__}")
    check_version(meta.get("version"), f"{where} ('{FORMAT_KEY}')", FORMAT_VERSION)
    scalar_keys = meta.get("scalar_keys", [])
    if not isinstance(scalar_keys, (list, tuple)) or not all(isinstance(k, str) for k in scalar_keys):
        raise ValueError(f"{where}: '{FORMAT_KEY}' 'scalar_keys' must be a list of key names, found {scalar_keys!r}")
    for key, kind, expected in (("optimizer", str, "a class name"), ("world_size", int, "an int")):
        value = meta.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(
                f"{where}: '{FORMAT_KEY}' '{key}' must be {expected} or None, found {type(value).__name__}"
            )
    return meta


def full_dict_source(full: Any, *, label: str = FULL_DICT) -> Source:
    """A full dict as a planning source: every parameter a flat of its own (world size 1), in ``param_names``
    order; per-rank units' read from ``"per_rank_state"[rank]``. Checks the dict's own consistency, raising
    ``ValueError`` listing every problem; fit to a model is the plan's job. ``read`` copies from the dict's tensors.
    """
    check_full_dict(full, label)
    check_state_dict(full, label, in_memory=True)  # bounded walk, tensor kinds, skeleton: before any read
    meta = read_meta(full, label)
    scalar_keys = frozenset(meta["scalar_keys"]) if meta and "scalar_keys" in meta else None
    errors: list[str] = []
    names = _names(full, label, errors)
    index = {pid: i for i, pid in enumerate(names)}
    groups = _groups(full, index, label, errors)
    sections = _per_rank_sections(full, meta, names, label, errors)
    state = full["state"]
    flats = []
    for pid, name in names.items():
        if sections and pid in sections[0]:
            flats.append(_per_rank_record(name, [s[pid] for s in sections], scalar_keys, label, errors))
        else:
            flats.append(param_record(name, state.get(pid) or {}, scalar_keys, label, errors))
    if errors:
        raise plan_error(errors)
    ids = list(names)

    def reader(entries_of: Mapping[Any, Any]) -> Reader:
        def read(i: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
            out.copy_(entries_of[ids[i]][key].detach().reshape(-1)[start:stop])

        return read

    def rank_reader(rank: int) -> Reader:
        shared, own = reader(state), reader(sections[rank])
        return lambda i, *rest: (own if flats[i].per_rank else shared)(i, *rest)

    optimizer = meta.get("optimizer") if meta else None
    return Source(label, optimizer, tuple(flats), groups, reader(state), len(sections) or None, False,
                  rank_reader=rank_reader if sections else None)  # fmt: skip


def _per_rank_sections(
    full: Mapping[str, Any], meta: Mapping[str, Any] | None, names: Mapping[Any, str], label: str, errors: list[str]
) -> list[Mapping[Any, Any]]:
    """``"per_rank_state"`` as one ``{id: entries}`` per rank 0..W-1 (empty without the section), checked."""
    sections = full.get(PER_RANK_KEY)
    if sections is None:
        return []
    world_size = meta.get("world_size") if meta else None
    # The header's world size is an int or None (read_meta checks it); without one (> 1) no section fits.
    if (
        not isinstance(world_size, int)
        or world_size < 2
        or not isinstance(sections, Mapping)
        or sorted(sections) != list(range(world_size))
    ):
        found = sorted(sections) if isinstance(sections, Mapping) else type(sections).__name__
        errors.append(
            f"{label}: '{PER_RANK_KEY}' must map every rank 0..W-1 of world size {world_size} (> 1), found {found}"
        )
        return []
    ordered = [sections[r] for r in range(world_size)]
    expected = set(ordered[0]) if isinstance(ordered[0], Mapping) else set()
    for rank, section in enumerate(ordered):
        if not isinstance(section, Mapping) or set(section) != expected:
            errors.append(f"{label}: '{PER_RANK_KEY}'[{rank}] must hold the ids {sorted(expected)} like rank 0")
            return []
    for pid in sorted(expected, key=repr):
        if pid not in names or pid in full["state"]:
            where = "'param_names' does not name it" if pid not in names else "it also has shared 'state'"
            errors.append(f"{label}: '{PER_RANK_KEY}' holds id {pid!r}, but {where}")
    return ordered


def _per_rank_record(
    name: str, per_rank: Sequence[Any], scalar_keys: frozenset[str] | None, label: str, errors: list[str]
) -> FlatRecord:
    """One per-rank parameter as a source flat: rank 0's record, which every rank's must match."""
    records = [param_record(name, entries, scalar_keys, label, errors) for entries in per_rank]
    for rank, record in enumerate(records[1:], start=1):
        for mine, theirs in zip(records[0].state, record.state):
            same = (mine.key, mine.kind, mine.dtype, mine.shape) == (
                theirs.key, theirs.kind, theirs.dtype, theirs.shape
            )
            if not same or (mine.kind is StateKind.SCALAR and not same_scalar(mine.value, theirs.value)):
                errors.append(
                    f"per-rank state '{mine.key}' of parameter '{name}' differs between rank 0 and rank {rank} in "
                    f"{label}: {_entry_text(mine)} vs {_entry_text(theirs)}; only tensor values may differ per rank"
                )
        if [e.key for e in record.state] != [e.key for e in records[0].state]:
            errors.append(
                f"per-rank state of parameter '{name}' has other keys on rank {rank} than on rank 0 in {label}"
            )
    return replace(records[0], per_rank=True)


def _entry_text(entry: StateEntry) -> str:
    return show_value(entry.value) if entry.kind is StateKind.SCALAR else f"{entry.dtype} {entry.shape}"


def _names(full: Mapping[str, Any], label: str, errors: list[str]) -> dict[Any, str]:
    names: dict[Any, str] = {}
    seen: dict[str, Any] = {}
    for pid, name in full["param_names"].items():
        if not isinstance(name, str):
            errors.append(f"{label}: 'param_names' gives id {pid!r} the name {name!r}, expected a string")
        elif name in seen:
            errors.append(f"{label}: 'param_names' gives '{name}' twice, to ids {seen[name]} and {pid}")
        else:
            seen[name] = pid
            names[pid] = name
    return names


def _groups(
    full: Mapping[str, Any], index: Mapping[Any, int], label: str, errors: list[str]
) -> tuple[GroupRecord, ...]:
    groups, listed = [], set()
    for k, group in enumerate(full["param_groups"]):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), (list, tuple)):
            errors.append(f"{label}: param group {k} must be a dict with a 'params' list, found {type(group).__name__}")
            continue
        for pid in group["params"]:
            if pid not in index:
                errors.append(f"{label}: param group {k} lists id {pid!r}, which 'param_names' does not name")
            listed.add(pid)
        hyper = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        members = tuple(index[pid] for pid in group["params"] if pid in index)
        groups.append(GroupRecord(hyper, members, named="param_names" in group))
    for pid in full["state"]:
        if pid not in listed:
            errors.append(f"{label} has state for id {pid!r}, which no param group lists")
    return tuple(groups)


def param_record(
    name: str, entries: Any, scalar_keys: frozenset[str] | None, label: str, errors: list[str]
) -> FlatRecord:
    """One parameter of a full dict as a source flat; ``shape``/``dtype`` come from its tensor state."""
    if not isinstance(entries, Mapping):
        errors.append(f"{label}: the state of parameter '{name}' must be a dict, found {type(entries).__name__}")
        entries = {}
    out = []
    for key, value in entries.items():
        if _is_scalar(key, value, scalar_keys):
            if torch.is_tensor(value) and value.dim() != 0:
                errors.append(
                    f"optimizer state '{key}' of parameter '{name}' has shape {tuple(value.shape)}, expected a 0-dim "
                    f"scalar ('{key}' is a scalar state in {label})"
                )
            out.append(StateEntry(key, StateKind.SCALAR, value=value))
        elif not torch.is_tensor(value):
            errors.append(
                f"optimizer state '{key}' of parameter '{name}' is a {type(value).__name__}, expected a tensor shaped "
                f"like the parameter ({label})"
            )
        else:
            out.append(StateEntry(key, StateKind.SHARDED, dtype=dtype_to_str(value.dtype), shape=tuple(value.shape)))
    tensor = next((e for e in out if e.kind is StateKind.SHARDED), None)
    # A sharded entry built above always has its dtype name and shape.
    shape = tensor.shape if tensor is not None and tensor.shape is not None else ()
    dtype = getattr(torch, tensor.dtype) if tensor is not None and tensor.dtype is not None else torch.float32
    spec = ParamSpec(name, shape, 0)
    return FlatRecord(unit="", params=(spec,), world_size=1, rank=None, dtype=dtype, flattened=False, state=tuple(out))


def _is_scalar(key: str, value: Any, scalar_keys: frozenset[str] | None) -> bool:
    # Our own dicts say which keys are scalars; for a plain optimizer's dict, fall back to the values.
    if scalar_keys is not None:
        return key in scalar_keys
    return key in KNOWN_SCALAR_KEYS or not torch.is_tensor(value) or value.dim() == 0
