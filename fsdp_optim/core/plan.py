"""The one engine: check a source of optimizer state against a target layout, once, into a frozen plan.

Pure: records in, records out; never opens files, never imports ``torch.distributed``.

Every entry point (``get_shard_from_optim_state_dict``, scatter, load, consolidate, reshard, the fairscale
and FSDP2 converters, the CLI) adapts its input to a :class:`Source`, calls :func:`plan` once, then
executes the plan per rank with :func:`cut_rank` (padded shards for one rank) or :func:`assemble_full`
(world-size-independent flat tensors). A new check belongs in :func:`plan`; a new format is one adapter
that builds a :class:`Source`.

A source is a list of *source flats* (:class:`~fsdp_optim.manifest.FlatRecord`: parameters, shapes,
world size, state entries), its param groups and a ``read`` callback. For a sharded checkpoint the
source flats are the saved FSDP units; for a full dict every parameter is a source flat of its own.

Worked example. Source: a checkpoint saved at world size 2 with units ``a`` (params ``a.w`` [2, 3],
``a.b`` [3]) and ``b`` (``b.w`` [4]). Target: one unit holding ``a.b``, ``b.w`` (9 elements at
offsets 0 and 3) at world size 3. The plan for target flat 0 is two segments::

    Segment(start=0, stop=3, source=0, source_start=6)   # a.b: elements 6..9 of source flat 0
    Segment(start=3, stop=7, source=1, source_start=0)   # b.w: elements 0..4 of source flat 1

and target rank 1 (real elements ``[3, 6)``, no padding) reads ``b.w[0:3]`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.core.flatten import StateKind, clone_value, same_scalar, show_value
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry

__all__ = [
    "FlatPlan",
    "Plan",
    "plan_error",
    "Reader",
    "Segment",
    "Source",
    "assemble_full",
    "cut_rank",
    "optimizer_state_dict",
    "plan",
    "restrict",
]

# read(source_flat, key, start, stop, out): copy elements [start, stop) of a source flat's full state into out.
Reader = Callable[[int, str, int, int, torch.Tensor], None]

_MAX_LISTED = 5  # errors spelled out in one PlanError; the rest are counted


def plan_error(errors: Sequence[str]) -> ValueError:
    """The ``ValueError`` for a source that does not fit its target: every problem found (the first
    few spelled out, each naming what and where with expected vs found), all of them in ``.errors``."""
    shown = "; ".join(errors[:_MAX_LISTED])
    more = len(errors) - _MAX_LISTED
    error = ValueError(shown + (f" (and {more} more problems)" if more > 0 else ""))
    # A plain ValueError carrying the list: transport.agree re-raises only built-in error types on the other
    # ranks, so a subclass would arrive there as a RuntimeError.
    error.errors = tuple(errors)  # type: ignore[attr-defined]
    return error


@dataclass(frozen=True)
class Source:
    """Optimizer state anywhere (a full dict, a sharded checkpoint, a foreign format), as the planner sees it.

    ``flats[i]`` are rank-independent records with their state entries; ``groups`` hold the
    hyperparameters and, per group, indices into ``flats``; ``read`` copies real elements of a source
    flat's full (unpadded) state. ``load_rank`` (sharded sources only) reads one saved rank's whole
    state ``{flat index: {key: padded shard or scalar}}``, used when the target is the saved layout.
    """

    label: str  # names the source in errors: "the full dict", "/ckpt/step100"
    optimizer: str | None  # class name it was saved from; None when unknown
    flats: tuple[FlatRecord, ...]
    groups: tuple[GroupRecord, ...]
    read: Reader
    world_size: int | None = None  # the world size it was saved at, when that means anything
    # False: a parameter without state has an unknown shape (full dicts); state shapes are checked instead.
    shapes_known: bool = True
    load_rank: Callable[[int], Mapping[int, Mapping[str, Any]]] | None = field(default=None, compare=False)
    # For sources with per-rank flats (MoE experts): the reader that reads rank r's own copy of them.
    rank_reader: Callable[[int], Reader] | None = field(default=None, compare=False)

    def reader(self, rank: int) -> Reader:
        """What rank ``rank`` reads: its own copy of per-rank flats, the shared state of the others."""
        return self.rank_reader(rank) if self.rank_reader is not None else self.read


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of a target flat are elements ``[source_start, ...)`` of source flat ``source``."""

    start: int
    stop: int
    source: int
    source_start: int


@dataclass(frozen=True)
class FlatPlan:
    entries: tuple[StateEntry, ...]  # what the target flat's state holds (scalars carry their value)
    segments: tuple[Segment, ...]  # tile [0, numel) of the target flat, in order


@dataclass(frozen=True)
class Plan:
    """How to build every target flat's state. ``groups`` hold the source's hyperparameters and target flat indices."""

    source: Source
    target: ModelLayout
    groups: tuple[GroupRecord, ...]
    flats: Mapping[int, FlatPlan]  # target flat index -> plan, only for flats with state
    identity: bool  # same units at the same world size: rank r's state is saved rank r's, as it is


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

    Raises ``ValueError`` (:func:`plan_error`) listing every problem found, each naming the parameter
    with expected vs found. Nothing is allocated before the plan exists.
    """
    errors: list[str] = []
    _check_world_sizes(target, errors)
    where = {spec.name: (i, spec) for i, flat in enumerate(source.flats) for spec in flat.params}
    group_of = {i: k for k, g in enumerate(source.groups) for i in g.flat_indices}
    target_names = {name for flat in target.flat_params for name in flat.names}
    extra = sorted(name for name in where if name not in target_names)
    if extra:
        errors.append(
            f"{source.label} has parameter '{extra[0]}' (and {len(extra) - 1} more), which the model does not have"
        )
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
    return Plan(source, target, out_groups, flats, _is_identity(source, target))


def _check_world_sizes(target: ModelLayout, errors: list[str]) -> None:
    for flat in target.flat_params:
        if flat.world_size not in (1, target.world_size):
            errors.append(
                f"{flat.describe()} is sharded over {flat.world_size} ranks but the root FSDP instance over "
                f"{target.world_size}; nested units must use the root's world size or 1"
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


# ---------------------------------------------------------------------------------------------------
# Executors: the plan, per rank or whole. They only copy; every check happened in plan().


def cut_rank(
    plan: Plan, rank: int, read: Reader | None = None, *, after_unit: Callable[[], None] | None = None
) -> dict[int, dict[str, Any]]:
    """Rank ``rank``'s state ``{target flat index: {key: padded shard or scalar}}``; every tensor new memory.

    Only the source elements that land in the rank's slice are read (through ``read``, default the
    source's own). ``after_unit`` runs after each flat (to release file mappings).
    """
    read = read or plan.source.reader(rank)
    out: dict[int, dict[str, Any]] = {}
    for t, flat_plan in plan.flats.items():
        bounds = plan.target.flat_params[t].bounds(rank if plan.target.flat_params[t].world_size > 1 else 0)
        entries: dict[str, Any] = {}
        for e in flat_plan.entries:
            if e.kind is StateKind.SCALAR:
                entries[e.key] = clone_value(e.value)
                continue
            # Segments tile the flat, so each real element is written once; only the padding needs zeros.
            shard = torch.empty(bounds.numel, dtype=dtype_from_str(e.dtype, where=e.key))
            shard[bounds.real :].zero_()
            _copy_range(flat_plan.segments, e.key, bounds.start, bounds.stop, shard, read)
            entries[e.key] = shard
        out[t] = entries
        if after_unit is not None:
            after_unit()
    return out


def assemble_full(
    plan: Plan,
    read: Reader | None = None,
    *,
    after_unit: Callable[[], None] | None = None,
    per_rank: int | None = None,
) -> dict[int, dict[str, Any]]:
    """Every target flat's full state ``{target flat index: {key: flat tensor (numel,) or scalar}}``, new memory.

    Shared flats only by default; with ``per_rank=r``, only the per-rank flats, as rank ``r`` holds them.
    """
    read = read or (plan.source.read if per_rank is None else plan.source.reader(per_rank))
    out: dict[int, dict[str, Any]] = {}
    for t, flat_plan in plan.flats.items():
        if plan.target.flat_params[t].per_rank != (per_rank is not None):
            continue
        numel = plan.target.flat_params[t].numel
        entries: dict[str, Any] = {}
        for e in flat_plan.entries:
            if e.kind is StateKind.SCALAR:
                entries[e.key] = clone_value(e.value)
                continue
            flat_full = torch.empty(numel, dtype=dtype_from_str(e.dtype, where=e.key))
            _copy_range(flat_plan.segments, e.key, 0, numel, flat_full, read)
            entries[e.key] = flat_full
        out[t] = entries
        if after_unit is not None:
            after_unit()
    return out


def restrict(plan: Plan, flat: int, key: str | None = None) -> Plan:
    """``plan`` for target flat ``flat`` only (and only state ``key``): the executors then build one unit, or one
    state tensor, so a writer that streams its output (one tensor at a time) never holds more. Nothing is re-checked."""
    flat_plan = plan.flats[flat]
    entries = tuple(e for e in flat_plan.entries if key is None or e.key == key)
    return replace(plan, flats={flat: FlatPlan(entries, flat_plan.segments)})


def _copy_range(segments: Sequence[Segment], key: str, start: int, stop: int, out: torch.Tensor, read: Reader) -> None:
    """Fill ``out`` with elements ``[start, stop)`` of a target flat from the segments that overlap them."""
    for seg in segments:
        lo, hi = max(seg.start, start), min(seg.stop, stop)
        if lo < hi:
            first = seg.source_start + lo - seg.start
            read(seg.source, key, first, first + hi - lo, out[lo - start : hi - start])


def optimizer_state_dict(plan: Plan, state: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """``{target flat: entries}`` -> what ``optim.load_state_dict`` takes; ids follow the plan's groups.

    ``{"state": {local_id: {key: shard or scalar}}, "param_groups": [{...hyperparams, "params": [local_id]}]}``
    """
    out_state: dict[int, Any] = {}
    out_groups = []
    next_id = 0
    for group in plan.groups:
        ids = []
        for t in group.flat_indices:
            if t in state:
                out_state[next_id] = dict(state[t])
            ids.append(next_id)
            next_id += 1
        out_groups.append({**{k: clone_value(v) for k, v in group.hyperparams.items()}, "params": ids})
    return {"state": out_state, "param_groups": out_groups}
