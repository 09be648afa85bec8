"""The one engine: check a source of optimizer state against a target layout, once, into a frozen plan.

Every entry point (``get_shard_from_optim_state_dict``, scatter, load, consolidate, reshard, the fairscale
and FSDP2 converters, the CLI) adapts its input to a :class:`.source.Source`, calls :func:`plan` once, then
executes the plan per rank with :func:`.execute.cut_rank` (padded shards for one rank) or
:func:`.execute.assemble_full` (world-size-independent flat tensors). A new check belongs in :func:`plan`; a new
format is one adapter that builds a :class:`.source.Source`.

Worked example. Source: a checkpoint saved at world size 2 with units ``a`` (params ``a.w`` [2, 3],
``a.b`` [3]) and ``b`` (``b.w`` [4]). Target: one unit holding ``a.b``, ``b.w`` (9 elements at
offsets 0 and 3) at world size 3. The plan for target flat 0 is two segments::

    Segment(start=0, stop=3, source=0, source_start=6)   # a.b: elements 6..9 of source flat 0
    Segment(start=3, stop=7, source=1, source_start=0)   # b.w: elements 0..4 of source flat 1

and target rank 1 (real elements ``[3, 6)``, no padding) reads ``b.w[0:3]`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.flatten import StateKind, same_scalar, show_value
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.records import FlatRecord, StateEntry
from fsdp_optim.core.source import FlatPlan, Plan, Segment, Source, plan_error

__all__ = [
    "per_parameter",
    "plan",
]


def per_parameter(source: Source, order: Sequence[str]) -> ModelLayout:
    """The source's parameters, each a flat of its own at world size 1: the target that makes full tensors."""
    flats = tuple(
        FlatParamLayout(flat.unit, (ParamSpec(spec.name, spec.shape, 0),), 1, 0, flat.dtype, flattened=False)
        for flat in source.flats
        for spec in flat.params
    )
    return ModelLayout(flats, tuple(order), 1, 0)


def plan(
    source: Source,
    target: ModelLayout,
    *,
    members: Sequence[Sequence[int]] | None = None,
    required: Sequence[bool] | None = None,
    order: Sequence[int] | None = None,
) -> Plan:
    """Check that ``source`` fits ``target`` and say where every target element comes from.

    Args:
        source: the state to place.
        target: the layout to cut for (any world size, any nesting of the same parameters).
        members: target flat indices per param group of the optimizer that will hold the state, in its
            order; ``None`` takes the source's groups, members ordered by ``order`` (default: index).
        required: per target flat, whether it must have state in ``source`` when ``members`` is ``None``
            (its parameters train); with ``members``, membership in a group is what requires it.
        order: a sort key per target flat for groups derived from the source.

    Raises ``ValueError`` (:func:`.source.plan_error`) listing every problem found, each naming the parameter
    with expected vs found. Nothing is allocated before the plan exists.
    """
    errors = target.world_size_errors()
    where = {spec.name: (i, spec) for i, flat in enumerate(source.flats) for spec in flat.params}
    group_of = {i: k for k, g in enumerate(source.groups) for i in g.flat_indices}
    _check_extra(source, where, target, errors)
    if members is not None and len(members) != len(source.groups):
        errors.append(f"the optimizer has {len(members)} param groups but {source.label} has {len(source.groups)}")
        raise plan_error(errors)
    live_group = {i: k for k, group in enumerate(members or []) for i in group}

    flats: dict[int, FlatPlan] = {}
    derived: list[list[int]] = [[] for _ in source.groups]
    for t, flat in enumerate(target.flat_params):
        needed = t in live_group if members is not None else bool(required and required[t])
        used = _sources_of(source, where, flat, needed, errors)
        if used is None:
            continue
        _check_per_rank(source, target, flat, used, errors)
        group = _group_of(source, group_of, flat, used, errors)
        if members is None:
            if isinstance(group, int):
                derived[group].append(t)
        elif group != live_group.get(t, None) and group != "split":
            errors.append(_group_mismatch(source, flat, group, live_group.get(t)))
        entries = _merge_entries(source, flat, used, errors)
        if entries:
            flats[t] = FlatPlan(entries, _segments(where, flat))
    if errors:
        raise plan_error(errors)
    if members is None:
        members = [sorted(m, key=(lambda t: order[t]) if order is not None else None) for m in derived]
    out_groups = tuple(replace(g, flat_indices=tuple(m)) for g, m in zip(source.groups, members, strict=True))
    shards = (ShardIndex.of(target.flat_params), ShardIndex.of(source.flats))
    return Plan(source, target, out_groups, flats, _is_identity(source, target), *shards)


def _check_extra(source: Source, where: Mapping[str, Any], target: ModelLayout, errors: list[str]) -> None:
    target_names = {name for flat in target.flat_params for name in flat.names}
    extra = sorted(name for name in where if name not in target_names)
    if extra:
        errors.append(
            f"{source.label} has parameter '{extra[0]}' (and {len(extra) - 1} more), which the model does not have"
        )


def _sources_of(
    source: Source, where: Mapping[str, tuple[int, Any]], flat: FlatParamLayout, needed: bool, errors: list[str]
) -> list[int] | None:
    """Source flats holding ``flat``'s parameters, in first-use order; ``None`` if it takes no state."""
    present = [spec for spec in flat.params if spec.name in where]
    if not present:
        if needed:
            errors.append(f"parameter '{flat.params[0].name}' of {flat.describe()} is missing from {source.label}")
        return None
    if len(present) != len(flat.params):
        missing = next(spec.name for spec in flat.params if spec.name not in where)
        errors.append(
            f"parameter '{missing}' of {flat.describe()} is missing from {source.label} while "
            f"'{present[0].name}' of the same unit is present"
        )
        return None
    used: list[int] = []
    for spec in flat.params:
        s, saved = where[spec.name]
        if source.shapes_known and saved.shape != spec.shape:
            errors.append(
                f"parameter '{spec.name}' has shape {spec.shape} in the model but {saved.shape} in {source.label}"
            )
        if s not in used:
            used.append(s)
    return used


def _check_per_rank(
    source: Source, target: ModelLayout, flat: FlatParamLayout, used: Sequence[int], errors: list[str]
) -> None:
    """Per-rank state (MoE experts: a unit over its own rank only) maps rank r to rank r, at the saved world size."""
    kinds = {source.flats[s].per_rank for s in used}
    if kinds != {flat.per_rank}:
        saved = "per-rank (each rank its own copy)" if True in kinds else "shared by all ranks"
        live = "per-rank" if flat.per_rank else "shared"
        errors.append(f"{flat.describe()} is {live} in the model but its state is {saved} in {source.label}")
    elif flat.per_rank and source.world_size != target.world_size:
        errors.append(
            f"{flat.describe()} holds per-rank state (MoE experts) saved by {source.world_size} ranks in "
            f"{source.label}; each rank keeps its own copy, so it loads only at world size {source.world_size}, "
            f"found {target.world_size}"
        )


def _group_of(
    source: Source, group_of: Mapping[int, int], flat: FlatParamLayout, used: Sequence[int], errors: list[str]
) -> int | str | None:
    """The source group of the target flat's parameters (``None``: in no group; ``"split"``: refused)."""
    found = {group_of.get(s) for s in used}
    if len(found) == 1:
        return found.pop()
    detail = ", ".join(f"'{source.flats[s].params[0].name}' in group {group_of.get(s)}" for s in used)
    errors.append(
        f"{source.label} splits {flat.describe()} over param groups: {detail}; all parameters of one flat "
        "parameter must share a param group"
    )
    return "split"


def _group_mismatch(source: Source, flat: FlatParamLayout, saved: int | str | None, live: int | None) -> str:
    saved_in = "no param group" if saved is None else f"group {saved}"
    live_in = "no param group" if live is None else f"group {live}"
    return f"parameter '{flat.params[0].name}' is in {saved_in} of {source.label} but in {live_in} of the optimizer"


def _merge_entries(
    source: Source, flat: FlatParamLayout, used: Sequence[int], errors: list[str]
) -> tuple[StateEntry, ...]:
    """The state entries of a target flat made of source flats ``used``; they must agree with each other."""
    records = [source.flats[s] for s in used]
    with_state = [r for r in records if r.state]
    if not with_state:
        return ()
    first = with_state[0]
    if len(with_state) != len(records):
        lacking = next(r for r in records if not r.state)
        errors.append(
            f"parameter '{lacking.params[0].name}' has no optimizer state in {source.label} but "
            f"'{first.params[0].name}' has, and the model puts both in {flat.describe()}"
        )
        return ()
    keys = [e.key for e in first.state]
    for other in with_state[1:]:
        if {e.key for e in other.state} != set(keys):
            errors.append(
                f"parameter '{other.params[0].name}' has state keys {sorted(e.key for e in other.state)} in "
                f"{source.label}, expected {sorted(keys)} like '{first.params[0].name}' of the same {flat.describe()}"
            )
            return ()
    count = len(errors)
    for entry in first.state:
        for other in with_state:
            _check_entry(source, flat, first, entry, other, errors)
    return first.state if len(errors) == count else ()


def _check_entry(
    source: Source, flat: FlatParamLayout, first: FlatRecord, entry: StateEntry, other: FlatRecord, errors: list[str]
) -> None:
    """One state key of source flat ``other`` against the target flat and against ``first``'s value."""
    found = other.entry(entry.key)
    name = other.params[0].name
    if entry.kind is StateKind.SHARDED:
        want = dtype_to_str(flat.dtype)
        if found.kind is not StateKind.SHARDED:
            errors.append(
                f"optimizer state '{entry.key}' of parameter '{name}' is a scalar in {source.label}, expected a "
                f"tensor shaped like the parameter {other.params[0].shape}"
            )
        elif found.shape is not None and found.shape != _model_shape(flat, name):
            errors.append(
                f"optimizer state '{entry.key}' of parameter '{name}' has shape {found.shape}, expected the "
                f"parameter's shape {_model_shape(flat, name)} ({source.label})"
            )
        elif found.dtype != want:
            errors.append(
                f"optimizer state '{entry.key}' of parameter '{name}' has dtype {found.dtype} (torch.{found.dtype}) "
                f"in {source.label}, expected {want} (torch.{want}), the parameter's dtype in the model"
            )
    elif found.kind is not StateKind.SCALAR or not same_scalar(entry.value, found.value):
        shown = show_value(found.value) if found.kind is StateKind.SCALAR else "a tensor"
        errors.append(
            f"scalar optimizer state '{entry.key}' differs inside {flat.describe()}: '{first.params[0].name}' has "
            f"{show_value(entry.value)}, '{name}' has {shown}; one flat parameter holds one value ({source.label})"
        )


def _model_shape(flat: FlatParamLayout, name: str) -> tuple[int, ...]:
    return next(spec.shape for spec in flat.params if spec.name == name)


def _segments(where: Mapping[str, tuple[int, Any]], flat: FlatParamLayout) -> tuple[Segment, ...]:
    """Runs of the target flat that are contiguous in one source flat, merged; they tile ``[0, numel)``."""
    segments: list[Segment] = []
    for spec in flat.params:
        s, saved = where[spec.name]
        last = segments[-1] if segments else None
        if last is not None and last.source == s and last.source_start + last.stop - last.start == saved.offset:
            segments[-1] = Segment(last.start, last.stop + spec.numel, s, last.source_start)
        else:
            segments.append(Segment(spec.offset, spec.offset + spec.numel, s, saved.offset))
    assert all(a.stop == b.start for a, b in zip(segments, segments[1:])), f"{flat.describe()}: segments do not tile"
    return tuple(segments)


def _is_identity(source: Source, target: ModelLayout) -> bool:
    if source.world_size != target.world_size or len(source.flats) != len(target.flat_params):
        return False
    return all(
        s.params == t.params and s.world_size == t.world_size and s.dtype == t.dtype
        for s, t in zip(source.flats, target.flat_params)
    )
