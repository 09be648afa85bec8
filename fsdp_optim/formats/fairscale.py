"""Conversions to and from formats other tools write and read. Pure: dicts in, dicts out; inputs never modified.

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

from fsdp_optim.core.execute import assemble_full
from fsdp_optim.core.flatten import same_scalar, show_value
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import GroupRecord
from fsdp_optim.core.source import Source, plan_error
from fsdp_optim.disk.objects import check_state_dict
from fsdp_optim.formats.fullstate import FORMAT_KEY, PER_RANK_KEY, build_full_state, full_dict_source, param_record

__all__ = ["fairscale_source", "from_fairscale", "is_fairscale_native", "to_named"]

_NATIVE_KEYS = ("state", "param_groups", "param_id_map", "uncollected_local_ids")
NATIVE = "the fairscale dict"


def is_fairscale_native(obj: object) -> bool:
    """Whether ``obj`` looks like fairscale's ``gather_full_optim_state_dict`` output."""
    return isinstance(obj, Mapping) and all(k in obj for k in _NATIVE_KEYS)


def from_fairscale(
    native: Mapping[str, Any],
    layout: ModelLayout,
    *,
    optimizer: str | None = None,
    step_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Our full dict (:mod:`fsdp_optim.formats.fullstate`) from a fairscale-native one (not modified).

    ``layout``: the wrapping the dict was saved from (fairscale's ids are positions in FSDP-instance order;
    :func:`fsdp_optim.offline.layouts.resolve_layout` makes one from the model, a sharded checkpoint or a layout
    file); ``optimizer``: the class name for ``"fsdp_optim"`` (``None``: unknown, its check skipped);
    ``step_dtype``: fairscale turns ``step`` into a Python number; it becomes a 0-dim tensor of this dtype, as
    torch's optimizers keep it. Per-rank 0-dim states must agree across ranks and become one value per parameter.
    """
    source = fairscale_source(native, layout, optimizer=optimizer, step_dtype=step_dtype)
    the_plan = plan(source, layout)
    return build_full_state(layout, the_plan.groups, assemble_full(the_plan), optimizer=optimizer)


def fairscale_source(
    native: Mapping[str, Any],
    layout: ModelLayout,
    *,
    optimizer: str | None = None,
    step_dtype: torch.dtype = torch.float32,
) -> Source:
    """A fairscale-native dict as a planning source: one source flat per parameter, named from ``layout``."""
    check_state_dict(native, NATIVE, in_memory=True)  # bounded walk, tensor kinds, skeleton: before any read
    slots = _check_native(native, layout)
    state = native["state"]
    errors: list[str] = []
    per_param: dict[int, dict[str, Any]] = {}
    for i, flat in enumerate(layout.flat_params):
        gids = [gid for gid, (j, _) in enumerate(slots) if j == i]
        per_rank = _per_rank_scalars(flat, [state.get(gid) or {} for gid in gids], errors)
        for gid in gids:
            entries = state.get(gid) or {}
            if entries:
                values = {k: v for k, v in entries.items() if not isinstance(v, list)}
                per_param[gid] = {**values, **per_rank}
                step = per_param[gid].get("step")
                if isinstance(step, (int, float)) and not isinstance(step, bool):
                    per_param[gid]["step"] = torch.tensor(float(step), dtype=step_dtype)
    names = [layout.flat_params[i].params[p].name for i, p in slots]
    for gid, entries in per_param.items():
        _check_plausible(names[gid], entries, errors)
    flats = tuple(param_record(names[gid], per_param.get(gid, {}), None, NATIVE, errors) for gid in range(len(slots)))
    if errors:
        raise plan_error(errors)
    hyper = {k: v for k, v in native["param_groups"][0].items() if k != "params"}

    def read(gid: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(state[gid][key].detach().reshape(-1)[start:stop])

    groups = (GroupRecord(hyper, tuple(range(len(slots)))),)
    return Source(NATIVE, optimizer, flats, groups, read, shapes_known=False)


# Second moments: sums of squares, never negative (Adam/AdamW/NAdam/RAdam/Adamax's and RMSprop's).
_NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg")


def _check_plausible(name: str, entries: Mapping[str, Any], errors: list[str]) -> None:
    """Refuse state no optimizer step produces, naming the check (fairscale's CPU gather once wrote it).

    - two state tensors of one parameter byte-identical and not all zero (an elementwise optimizer keeps
      different quantities under different keys: Adam's ``exp_avg`` is a mean, ``exp_avg_sq`` a mean of
      squares);
    - a second moment (:data:`_NON_NEGATIVE`) holding a negative value.
    """
    tensors = [(k, v) for k, v in entries.items() if torch.is_tensor(v) and v.dim() > 0 and v.is_floating_point()]
    for i, (key, value) in enumerate(tensors):
        for other, twin in tensors[i + 1 :]:
            if value.shape == twin.shape and value.dtype == twin.dtype and bool(value.any()):
                if torch.equal(value.reshape(-1).view(torch.uint8), twin.reshape(-1).view(torch.uint8)):
                    errors.append(
                        f"parameter '{name}': '{key}' and '{other}' are byte-identical, which no optimizer step "
                        "gives (plausibility check: distinct state keys hold distinct values). fairscale's own "
                        "gather_full_optim_state_dict returns such a dict on a CPU outside "
                        "fsdp_optim.host_execution(); gather again inside it, or with "
                        "fsdp_optim.gather_full_optim_state_dict"
                    )
        if key in _NON_NEGATIVE and bool((value < 0).any()):
            errors.append(
                f"parameter '{name}': '{key}' holds negative values, expected a second moment (plausibility "
                f"check: '{key}' is a mean of squares, never negative)"
            )


def _check_native(native: Any, layout: ModelLayout) -> list[tuple[int, int]]:
    """fairscale's own bookkeeping; returns ``(flat index, position)`` per fairscale global id."""
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
    slots = [(i, position) for i, flat in enumerate(layout.flat_params) for position in range(len(flat.params))]
    id_map = dict(native["param_id_map"])
    if sorted(id_map) != list(range(len(slots))) or list(groups[0]["params"]) != list(range(len(slots))):
        raise ValueError(
            f"the fairscale dict numbers {len(id_map)} parameters (param group: {len(groups[0]['params'])}), "
            f"but the layout has {len(slots)} in {len(layout.flat_params)} FSDP units; was it saved from "
            "another model or wrapping?"
        )
    extra = sorted(set(native["state"]) - set(range(len(slots))), key=repr)
    if extra:
        raise ValueError(f"the fairscale dict has state for id {extra[0]!r}, beyond its {len(slots)} parameters")
    for gid, (i, position) in enumerate(slots):
        local = id_map[gid]
        name = layout.flat_params[i].params[position].name
        if local not in (None, i):
            raise ValueError(
                f"parameter '{name}' (fairscale id {gid}) maps to local id {local}, expected {i} (its FSDP "
                "unit's index) or None; was the dict saved from another wrapping?"
            )
        if (local is None) != (not native["state"].get(gid)):
            raise ValueError(
                f"parameter '{name}' (fairscale id {gid}): param_id_map says {local}, but its state is "
                f"{'empty' if not native['state'].get(gid) else 'present'}"
            )
    return slots


def _per_rank_scalars(flat: Any, entries: list[Mapping[str, Any]], errors: list[str]) -> dict[str, torch.Tensor]:
    """fairscale keeps 0-dim states other than ``step`` as one value per rank on a unit's last parameter:
    they must agree, and become the unit's one value (given to every parameter of the unit)."""
    out: dict[str, torch.Tensor] = {}
    keys = sorted({k for e in entries for k, v in e.items() if isinstance(v, list)})
    for key in keys:
        values = [v for e in entries if isinstance(e.get(key), list) for v in e[key]]
        if not values or not all(torch.is_tensor(v) and v.dim() == 0 for v in values):
            errors.append(f"per-rank state '{key}' of {flat.describe()}: expected a list of 0-dim tensors")
            continue
        differing = next((v for v in values[1:] if not same_scalar(values[0], v)), None)
        if differing is not None:
            errors.append(
                f"per-rank state '{key}' of {flat.describe()} differs across ranks: {show_value(values[0])} vs "
                f"{show_value(differing)}; one flat parameter holds one value"
            )
            continue
        out[key] = values[0]
    return out


def to_named(full: Mapping[str, Any]) -> dict[str, Any]:
    """Our full dict keyed by parameter name, for FSDP2's (DCP's) ``set_optimizer_state_dict``, on every rank::

        set_optimizer_state_dict(model, optim, named, options=StateDictOptions(full_state_dict=True, strict=False))

    (``strict=False``: parameters that never had a gradient have no state, which PyTorch's strict check refuses.)
    ``"param_names"`` and ``"fsdp_optim"`` are not carried over; tensors are shared with ``full``, not copied.
    """
    if full_dict_source(full).rank_reader is not None:
        raise ValueError(
            f"the full dict holds per-rank state ('{PER_RANK_KEY}', MoE experts: each rank its own copy of "
            f"{list(full[FORMAT_KEY].get('per_rank_units', []))}), which has no one name per parameter for FSDP2; "
            "load it with fsdp_optim at its own world size instead"
        )
    names = full["param_names"]
    state = {names[pid]: {k: _detached(v) for k, v in entries.items()} for pid, entries in full["state"].items()}
    groups = []
    for group in full["param_groups"]:
        out = {key: _detached(v) for key, v in group.items() if key not in ("params", "param_names")}
        out["params"] = [names[pid] for pid in group["params"]]
        groups.append(out)
    return {"state": state, "param_groups": groups}


def is_named_dict(obj: object) -> bool:
    """Whether ``obj`` is what :func:`to_named` writes: state and group members keyed by parameter name."""
    if not isinstance(obj, Mapping) or "param_names" in obj or not isinstance(obj.get("state"), Mapping):
        return False
    groups = obj.get("param_groups")
    return (
        isinstance(groups, (list, tuple))
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups)
        and all(isinstance(n, str) for g in groups for n in g["params"])
        and all(isinstance(n, str) for n in obj["state"])
        and any(g["params"] for g in groups)
    )


def _detached(value: Any) -> Any:
    # The value itself, or one sharing its memory without its autograd history.
    return value.detach() if torch.is_tensor(value) and value.requires_grad else value


def dict_source(obj: Any, layout: ModelLayout, *, label: str, optimizer: str | None = None) -> Source:
    """The planning source for a dict handed to a live model: our full dict, or fairscale's own gathered
    dict (recognised by its keys; the live model's ``layout`` numbers its parameters, and ``optimizer``
    names its class, which fairscale does not record)."""
    if is_fairscale_native(obj):
        return fairscale_source(obj, layout, optimizer=optimizer)
    return full_dict_source(obj, label=label)
