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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .flatten import StateKind, clone_value, cut, split
from .layout import FlatParamLayout, ModelLayout

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "GroupSpec",
    "build_full_state",
    "read_meta",
    "saved_optimizer",
    "same_scalar",
    "shard_full_state",
    "show_value",
]

FORMAT_KEY = "fsdp_optim"
FORMAT_VERSION = 1
# 0-dim states that torch's optimizers keep per parameter; used to read full dicts made without fsdp_optim.
KNOWN_SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})


@dataclass(frozen=True)
class GroupSpec:
    """One param group of the sharded optimizer, in terms of flat parameters."""

    hyperparams: Mapping[str, Any]  # everything but "params" (and "param_names")
    flat_indices: tuple[int, ...]  # into ModelLayout.flat_params, in the optimizer's order
    named: bool  # the group carried "param_names"


def build_full_state(
    layout: ModelLayout,
    groups: Sequence[GroupSpec],
    flat_states: Mapping[int, Mapping[str, Any]],
    *,
    optimizer: str,
) -> dict[str, Any]:
    """The full dict from each flat parameter's full state.

    ``flat_states[i]`` maps each state key of flat parameter ``i`` to either a flat full tensor (1-D,
    ``numel`` elements, padding already dropped) or a scalar (0-dim tensor / Python value). Flat
    tensors are split into views, so the result shares their storage; scalars are cloned per parameter
    so that no two parameters alias one ``step`` tensor.
    """
    order = layout.order_index()
    state: dict[int, dict[str, Any]] = {}
    names: dict[int, str] = {}
    out_groups: list[dict[str, Any]] = []
    scalar_keys: set[str] = set()
    next_id = 0
    for group in groups:
        members: list[tuple[str, int, int]] = []  # (name, flat index, position in flat)
        for flat_index in group.flat_indices:
            for position, spec in enumerate(layout.flat_params[flat_index].params):
                members.append((spec.name, flat_index, position))
        members.sort(key=lambda m: order[m[0]])
        splits: dict[int, dict[str, list[torch.Tensor]]] = {}
        ids = []
        for name, flat_index, position in members:
            pid, next_id = next_id, next_id + 1
            ids.append(pid)
            names[pid] = name
            flat_state = flat_states.get(flat_index)
            if not flat_state:
                continue
            if flat_index not in splits:
                flat = layout.flat_params[flat_index]
                splits[flat_index] = {k: split(flat, v) for k, v in flat_state.items() if _is_flat_full(v)}
            entry = {}
            for key, value in flat_state.items():
                if key in splits[flat_index]:
                    entry[key] = splits[flat_index][key][position]
                else:
                    entry[key] = clone_value(value)
                    scalar_keys.add(key)
            state[pid] = entry
        out_group = {k: clone_value(v) for k, v in group.hyperparams.items()}
        out_group["params"] = ids
        if group.named:
            out_group["param_names"] = [names[i] for i in ids]
        out_groups.append(out_group)
    meta = {
        "version": FORMAT_VERSION,
        "optimizer": optimizer,
        "world_size": layout.world_size,
        "scalar_keys": sorted(scalar_keys),
    }
    return {"state": state, "param_groups": out_groups, "param_names": names, FORMAT_KEY: meta}


def _is_flat_full(value: Any) -> bool:
    # Scalars are 0-dim tensors or Python values, so any 1-D tensor here is a flat full tensor.
    return torch.is_tensor(value) and value.dim() == 1


# ---------------------------------------------------------------------------------------------------
# Full dict -> this rank's shard


def shard_full_state(
    layout: ModelLayout,
    full: Mapping[str, Any],
    *,
    live_groups: Sequence[Sequence[int]] | None,
    param_positions: Sequence[int],
    trainable: Sequence[bool],
) -> dict[str, Any]:
    """This rank's optimizer state dict, cut from ``full`` after checking it fits the model.

    Args:
        layout: the model as it is wrapped now (any world size, any nesting).
        full: a full dict (see the module docstring). Never modified.
        live_groups: flat indices per param group of the live sharded optimizer, in its order, or
            ``None`` to derive the groups from ``full`` and order flat parameters by ``param_positions``.
        param_positions: a sort key per flat parameter (its position in ``model.parameters()``).
        trainable: ``requires_grad`` per flat parameter; frozen ones may be absent from ``full``.

    Returns ``{"state": {local_id: {key: shard or scalar}}, "param_groups": [{..., "params": [ids]}]}``,
    ready for ``optim.load_state_dict``. Every tensor is new memory.

    Raises ``ValueError`` naming the parameter with what was expected and what was found.
    """
    layout.check_world_sizes()
    names, group_of = read_header(full)
    groups = full["param_groups"]
    if live_groups is not None and len(live_groups) != len(groups):
        raise ValueError(
            f"the optimizer has {len(live_groups)} param groups but the full optimizer state dict has {len(groups)}"
        )
    flat_group = _check_membership(layout, names, group_of, live_groups, trainable)
    if live_groups is None:
        live_groups = [
            sorted((i for i, g in flat_group.items() if g == k), key=lambda i: param_positions[i])
            for k in range(len(groups))
        ]
    meta = read_meta(full)
    # Our own dicts say which keys are scalars; for a plain optimizer's dict, fall back to shapes.
    scalar_keys = frozenset(meta["scalar_keys"]) if meta and "scalar_keys" in meta else None
    id_of = {name: pid for pid, name in names.items()}
    state = full["state"]

    # First pass checks everything; only then is anything allocated, so a failure changes nothing.
    plans: dict[int, list[tuple[str, StateKind, list[Any]]]] = {}
    for flat_index in flat_group:
        flat = layout.flat_params[flat_index]
        per_param = [state.get(id_of[spec.name]) for spec in flat.params]
        plans[flat_index] = _plan_flat(flat, per_param, scalar_keys)

    out_state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    next_id = 0
    for k, members in enumerate(live_groups):
        ids = []
        for flat_index in members:
            pid, next_id = next_id, next_id + 1
            ids.append(pid)
            plan = plans.get(flat_index)
            if plan:
                flat = layout.flat_params[flat_index]
                out_state[pid] = {
                    key: cut(flat, values) if kind is StateKind.SHARDED else clone_value(values[0])
                    for key, kind, values in plan
                }
        group = {key: clone_value(v) for key, v in groups[k].items() if key not in ("params", "param_names")}
        group["params"] = ids
        out_groups.append(group)
    return {"state": out_state, "param_groups": out_groups}


def read_meta(full: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``"fsdp_optim"`` block of a full dict (``None`` for a plain optimizer's dict), checked."""
    meta = full.get(FORMAT_KEY)
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise TypeError(f"full optimizer state dict: '{FORMAT_KEY}' must be a dict, found {type(meta).__name__}")
    version = meta.get("version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(
            f"full optimizer state dict has format version {version!r}; this fsdp_optim reads versions up to "
            f"{FORMAT_VERSION}"
        )
    return meta


def saved_optimizer(full: Mapping[str, Any]) -> str | None:
    """The optimizer class a full dict was gathered from, per its checked header (``None`` if unknown)."""
    meta = read_meta(full)
    return meta.get("optimizer") if meta else None


def read_header(full: Mapping[str, Any]) -> tuple[dict[int, str], dict[int, int]]:
    if not isinstance(full, Mapping):
        raise TypeError(f"full optimizer state dict: expected a dict, found {type(full).__name__}")
    for key in ("state", "param_groups", "param_names"):
        if key not in full:
            raise ValueError(
                f"full optimizer state dict has no '{key}' key (found keys {sorted(map(str, full))}); "
                "expected the output of gather_full_optim_state_dict"
            )
    read_meta(full)
    names = dict(full["param_names"])
    seen: dict[str, int] = {}
    for pid, name in names.items():
        if name in seen:
            raise ValueError(f"full optimizer state dict: 'param_names' gives '{name}' twice, to ids {seen[name]} and {pid}")
        seen[name] = pid
    group_of: dict[int, int] = {}
    for k, group in enumerate(full["param_groups"]):
        for pid in group["params"]:
            if pid not in names:
                raise ValueError(f"param group {k} lists id {pid}, which 'param_names' does not name")
            group_of[pid] = k
    for pid in full["state"]:
        if pid not in group_of:
            raise ValueError(f"full optimizer state dict has state for id {pid}, which no param group lists")
    return names, group_of


def _check_membership(
    layout: ModelLayout,
    names: Mapping[int, str],
    group_of: Mapping[int, int],
    live_groups: Sequence[Sequence[int]] | None,
    trainable: Sequence[bool],
) -> dict[int, int]:
    """Full-dict group index per flat parameter that the dict covers."""
    known = {name: pid for pid, name in names.items() if pid in group_of}
    live_group = {i: k for k, members in enumerate(live_groups or []) for i in members}
    model_names = set()
    flat_group: dict[int, int] = {}
    for flat_index, flat in enumerate(layout.flat_params):
        model_names.update(flat.names)
        present = [spec.name for spec in flat.params if spec.name in known]
        if not present:
            in_optimizer = flat_index in live_group if live_groups is not None else trainable[flat_index]
            if in_optimizer:
                raise ValueError(
                    f"parameter '{flat.params[0].name}' of {flat.describe()} is missing from the full "
                    f"optimizer state dict (it has {len(known)} parameters)"
                )
            continue
        if len(present) != len(flat.params):
            missing = next(spec.name for spec in flat.params if spec.name not in known)
            raise ValueError(
                f"parameter '{missing}' of {flat.describe()} is missing from the full optimizer state dict "
                f"while '{present[0]}' of the same unit is present"
            )
        groups = {group_of[known[name]] for name in present}
        if len(groups) > 1:
            detail = ", ".join(f"'{n}' in group {group_of[known[n]]}" for n in present)
            raise ValueError(
                f"a param group splits {flat.describe()}: {detail}; all parameters of one flat parameter "
                "must share a param group"
            )
        flat_group[flat_index] = groups.pop()
        if live_groups is not None:
            if flat_index not in live_group:
                raise ValueError(f"{flat.describe()} has state in the full dict but is in no optimizer param group")
            if live_group[flat_index] != flat_group[flat_index]:
                raise ValueError(
                    f"parameter '{present[0]}' is in param group {flat_group[flat_index]} of the full dict but "
                    f"in group {live_group[flat_index]} of the optimizer"
                )
    extra = sorted(name for name in known if name not in model_names)
    if extra:
        raise ValueError(
            f"full optimizer state dict has parameter '{extra[0]}' (and {len(extra) - 1} more), which the model "
            "does not have"
        )
    return flat_group


def _plan_flat(
    flat: FlatParamLayout, per_param: Sequence[Mapping[str, Any] | None], scalar_keys: frozenset[str] | None
) -> list[tuple[str, StateKind, list[Any]]]:
    """Check one flat parameter's per-parameter state and say how to build its shard entry by entry."""
    with_state = [(spec, s) for spec, s in zip(flat.params, per_param) if s]
    if not with_state:
        return []
    if len(with_state) != len(flat.params):
        lacking = next(spec.name for spec, s in zip(flat.params, per_param) if not s)
        raise ValueError(
            f"parameter '{lacking}' has no optimizer state but '{with_state[0][0].name}' of the same "
            f"{flat.describe()} has; a flat parameter's state must cover all of its parameters"
        )
    first_spec, first_state = with_state[0]
    keys = list(first_state)
    for spec, s in with_state[1:]:
        if set(s) != set(keys):
            raise ValueError(
                f"parameter '{spec.name}' has state keys {sorted(s)}, expected {sorted(keys)} like "
                f"'{first_spec.name}' of the same {flat.describe()}"
            )
    plan = []
    for key in keys:
        values = [s[key] for _, s in with_state]
        if scalar_keys is not None:
            kind = StateKind.SCALAR if key in scalar_keys else StateKind.SHARDED
        elif key not in KNOWN_SCALAR_KEYS and all(
            torch.is_tensor(v) and tuple(v.shape) == spec.shape for (spec, _), v in zip(with_state, values)
        ):
            kind = StateKind.SHARDED
        else:
            kind = StateKind.SCALAR
        check = _check_sharded if kind is StateKind.SHARDED else _check_scalar
        check(flat, key, values)
        plan.append((key, kind, values))
    return plan


def _check_sharded(flat: FlatParamLayout, key: str, values: Sequence[Any]) -> None:
    for spec, value in zip(flat.params, values):
        found = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        if found != spec.shape:
            raise ValueError(
                f"optimizer state '{key}' of parameter '{spec.name}' has shape {found}, expected the "
                f"parameter's shape {spec.shape}"
            )
        if value.dtype != flat.dtype:
            raise ValueError(
                f"optimizer state '{key}' of parameter '{spec.name}' has dtype {value.dtype}, expected "
                f"{flat.dtype} (the parameter's)"
            )


def _check_scalar(flat: FlatParamLayout, key: str, values: Sequence[Any]) -> None:
    for spec, value in zip(flat.params, values):
        if torch.is_tensor(value) and value.dim() != 0:
            raise ValueError(
                f"optimizer state '{key}' of parameter '{spec.name}' has shape {tuple(value.shape)}, expected "
                f"the parameter's shape {spec.shape} or a 0-dim scalar"
            )
    for spec, value in zip(flat.params[1:], values[1:]):
        if not same_scalar(values[0], value):
            raise ValueError(
                f"scalar optimizer state '{key}' differs inside {flat.describe()}: '{flat.params[0].name}' has "
                f"{show_value(values[0])}, '{spec.name}' has {show_value(value)}; one flat parameter holds one value"
            )


def same_scalar(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if torch.is_tensor(a) or torch.is_tensor(b):
        return False
    return bool(a == b)


def show_value(value: Any) -> str:
    return f"{value.item()!r} ({value.dtype})" if torch.is_tensor(value) else repr(value)
