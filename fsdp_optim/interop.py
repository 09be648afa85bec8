"""Conversions to and from formats other tools write and read.

Pure: dicts in, dicts out; never imports ``torch.distributed``. Inputs are never modified.

- :func:`from_fairscale`: a dict written by fairscale's own ``gather_full_optim_state_dict`` -> our full dict.
  fairscale's format (0.4.x)::

      {"state": {global_id: {"exp_avg": Tensor[*shape], "step": 7.0 (a Python number),
                             "mu_product": [tensor(.9), tensor(.9)] (0-dim states: one per rank,
                                                                    on the last parameter of a unit)}},
       "param_groups": [{..., "params": [0, 1, ..., n - 1]}],          # exactly one group
       "param_id_map": {global_id: local_id or None},                  # local id = FSDP instance index
       "uncollected_local_ids": [local ids left on rank 0 unsharded]}

  Global ids follow FSDP-instance order (the root's own parameters first, then each nested instance
  in ``named_modules()`` order), each instance's parameters in flat order; nothing names them, so the
  model's layout (the model, a sharded checkpoint of it, or a ``save_layout`` file) is needed.

- :func:`to_named`: our full dict -> the same state keyed by parameter name, as PyTorch's
  ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` takes it (FSDP2 or a plain module)::

      {"state": {"embed.weight": {"step": tensor(3.), "exp_avg": Tensor[11, 6], ...}, ...},
       "param_groups": [{"lr": 0.01, ..., "params": ["embed.weight", ...]}, ...]}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .flatten import clone_value
from .fullstate import GroupSpec, build_full_state, same_scalar, show_value
from .layout import ModelLayout

__all__ = ["from_fairscale", "is_fairscale_native", "to_named"]

_NATIVE_KEYS = ("state", "param_groups", "param_id_map", "uncollected_local_ids")


def is_fairscale_native(obj: Any) -> bool:
    """Whether ``obj`` looks like fairscale's ``gather_full_optim_state_dict`` output."""
    return isinstance(obj, Mapping) and all(k in obj for k in _NATIVE_KEYS)


def from_fairscale(
    native: Mapping[str, Any],
    layout: ModelLayout,
    *,
    optimizer: str | None = None,
    step_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Our full dict (see :mod:`fsdp_optim.fullstate`) from a fairscale-native one.

    Args:
        native: fairscale's ``gather_full_optim_state_dict`` output. Not modified.
        layout: the wrapped model's layout (:func:`fsdp_optim.offline.resolve_layout` makes one from the
            model, a sharded checkpoint or a layout file). It must be the wrapping the dict was saved
            from: fairscale's ids are positions in FSDP-instance order.
        optimizer: the optimizer's class name, recorded in ``"fsdp_optim"``; ``None`` when unknown
            (loading then skips the optimizer-class check).
        step_dtype: fairscale turns ``step`` into a Python number; it becomes a 0-dim tensor of this
            dtype, as torch's optimizers keep it.

    Per-rank 0-dim states (one per rank, on the last parameter of each unit) must agree across ranks
    and become one value per parameter. Raises ``ValueError`` naming the parameter, expected vs found.
    """
    if not is_fairscale_native(native):
        found = sorted(map(str, native)) if isinstance(native, Mapping) else type(native).__name__
        raise ValueError(f"expected a fairscale-native dict with keys {list(_NATIVE_KEYS)}, found {found}")
    if native["uncollected_local_ids"]:
        raise ValueError(
            f"the fairscale dict has uncollected local ids {list(native['uncollected_local_ids'])} (units with "
            "no_broadcast_optim_state, whose state stayed rank-local); it holds no full state for them"
        )
    groups = native["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"a fairscale-native dict has exactly one param group, found {len(groups)}")
    layout.check_world_sizes()
    slots = [(i, position) for i, flat in enumerate(layout.flat_params) for position in range(len(flat.params))]
    id_map = dict(native["param_id_map"])
    if sorted(id_map) != list(range(len(slots))) or list(groups[0]["params"]) != list(range(len(slots))):
        raise ValueError(
            f"the fairscale dict numbers {len(id_map)} parameters (param group: {len(groups[0]['params'])}), "
            f"but the layout has {len(slots)} in {len(layout.flat_params)} FSDP units; was it saved from "
            "another model or wrapping?"
        )
    state = native["state"]
    per_flat: dict[int, list[tuple[int, Mapping[str, Any]]]] = {}
    for gid, (i, position) in enumerate(slots):
        local = id_map[gid]
        spec = layout.flat_params[i].params[position]
        if local not in (None, i):
            raise ValueError(
                f"parameter '{spec.name}' (fairscale id {gid}) maps to local id {local}, expected {i} (its FSDP "
                "unit's index) or None; was the dict saved from another wrapping?"
            )
        entries = state.get(gid)
        if (local is None) != (not entries):
            raise ValueError(
                f"parameter '{spec.name}' (fairscale id {gid}): param_id_map says {local}, but its state is "
                f"{'empty' if not entries else 'present'}"
            )
        if entries:
            per_flat.setdefault(i, []).append((position, entries))
    extra = sorted(set(state) - set(range(len(slots))), key=repr)
    if extra:
        raise ValueError(f"the fairscale dict has state for id {extra[0]!r}, beyond its {len(slots)} parameters")

    flat_states = {i: _flat_state(layout, i, entries, step_dtype) for i, entries in per_flat.items()}
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    spec = GroupSpec(hyper, tuple(range(len(layout.flat_params))), named=False)
    return build_full_state(layout, [spec], flat_states, optimizer=optimizer)  # type: ignore[arg-type]


def _flat_state(
    layout: ModelLayout, i: int, entries: list[tuple[int, Mapping[str, Any]]], step_dtype: torch.dtype
) -> dict[str, Any]:
    """One unit's flat full state from fairscale's per-parameter entries."""
    flat = layout.flat_params[i]
    if len(entries) != len(flat.params):
        lacking = {p for p, _ in entries}
        name = next(s.name for k, s in enumerate(flat.params) if k not in lacking)
        raise ValueError(f"parameter '{name}' of {flat.describe()} has no state in the fairscale dict, but others do")
    per_rank = {k for _, e in entries for k, v in e.items() if isinstance(v, list)}
    first_keys = set(entries[0][1]) - per_rank
    for p, e in entries[1:]:
        if set(e) - per_rank != first_keys:
            raise ValueError(
                f"parameter '{flat.params[p].name}' has state keys {sorted(set(e) - per_rank)} in the fairscale dict, "
                f"expected {sorted(first_keys)} like '{flat.params[entries[0][0]].name}' of the same {flat.describe()}"
            )
    tensor_keys = [k for k, v in entries[0][1].items() if torch.is_tensor(v) and v.dim() > 0]
    scalar_keys = [k for k in entries[0][1] if k not in tensor_keys and k not in per_rank]
    out: dict[str, Any] = {}
    for key in scalar_keys:
        values = [e.get(key) for _, e in entries]
        reference = values[0]
        for (p, _), v in zip(entries, values):
            if not same_scalar(reference, v):
                raise ValueError(
                    f"state '{key}' of '{flat.params[p].name}' is {show_value(v)}, expected {show_value(reference)} "
                    f"like the rest of {flat.describe()}"
                )
        if key == "step" and isinstance(reference, (int, float)) and not isinstance(reference, bool):
            out[key] = torch.tensor(float(reference), dtype=step_dtype)
        else:
            out[key] = clone_value(reference)
    for key in tensor_keys:
        pieces = []
        for (p, e) in entries:
            spec = flat.params[p]
            value = e.get(key)
            if not torch.is_tensor(value) or tuple(value.shape) != spec.shape:
                found = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"state '{key}' of parameter '{spec.name}' is {found}, expected shape {spec.shape}")
            pieces.append(value.reshape(-1))
        out[key] = torch.cat(pieces)
    for key in sorted(per_rank):
        lists = [e[key] for _, e in entries if key in e]
        values = [v for lst in lists for v in lst]
        if not values or not all(torch.is_tensor(v) and v.dim() == 0 for v in values):
            raise ValueError(f"per-rank state '{key}' of {flat.describe()}: expected a list of 0-dim tensors")
        for v in values[1:]:
            if not same_scalar(values[0], v):
                raise ValueError(
                    f"per-rank state '{key}' of {flat.describe()} differs across ranks: {show_value(values[0])} vs "
                    f"{show_value(v)}; one flat parameter holds one value"
                )
        out[key] = values[0].clone()
    return out


def to_named(full: Mapping[str, Any]) -> dict[str, Any]:
    """Our full dict keyed by parameter name, for ``set_optimizer_state_dict`` (FSDP2, DCP).

    Load it under FSDP2 with, on every rank::

        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optim, named, options=StateDictOptions(full_state_dict=True, strict=False))

    (``strict=False`` because parameters that never had a gradient have no state, which PyTorch's
    strict check refuses.) ``"param_names"`` and ``"fsdp_optim"`` are not carried over. Tensors are shared
    with ``full``, not copied; ``full`` is not modified.
    """
    for key in ("state", "param_groups", "param_names"):
        if not isinstance(full, Mapping) or key not in full:
            found = sorted(map(str, full)) if isinstance(full, Mapping) else type(full).__name__
            raise ValueError(f"expected our full dict with '{key}' (from gather_full_optim_state_dict), found {found}")
    names = full["param_names"]
    state = {}
    for pid, entries in full["state"].items():
        if pid not in names:
            raise ValueError(f"full dict: state for id {pid}, which 'param_names' does not name")
        state[names[pid]] = dict(entries)
    groups = []
    for k, group in enumerate(full["param_groups"]):
        missing = [pid for pid in group["params"] if pid not in names]
        if missing:
            raise ValueError(f"full dict: param group {k} lists id {missing[0]}, which 'param_names' does not name")
        out = {key: v for key, v in group.items() if key not in ("params", "param_names")}
        out["params"] = [names[pid] for pid in group["params"]]
        groups.append(out)
    return {"state": state, "param_groups": groups}
