"""Re-cutting sharded optimizer state for another world size or another wrapping of the same model.

Pure: works on a :class:`~fsdp_optim.manifest.Manifest` (the source), a target
:class:`~fsdp_optim.layout.ModelLayout` and a ``read`` callback that copies elements of a source flat
parameter's full state; never opens files, never imports ``torch.distributed``.

:func:`plan_recut` checks that the checkpoint fits the target (names, shapes, dtypes, param groups,
state keys) before anything is allocated, and says where each target flat parameter's elements come
from as *segments* of source flat parameters. :func:`recut_rank_state` then builds one rank's padded
shards, reading only the source ranges that overlap that rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .flatten import StateKind, clone_value
from .fullstate import same_scalar, show_value
from .layout import ModelLayout
from .manifest import GroupRecord, Manifest, StateEntry, dtype_from_str, dtype_to_str

__all__ = ["FlatPlan", "RecutPlan", "Segment", "at_rank", "plan_recut", "recut_rank_state"]

# read(source_flat_index, key, start, stop, out): copy elements [start, stop) of the source's flat full state.
Reader = Callable[[int, str, int, int, torch.Tensor], None]


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of a target flat parameter are elements ``source_start...`` of source flat ``source``."""

    start: int
    stop: int
    source: int
    source_start: int


@dataclass(frozen=True)
class FlatPlan:
    entries: tuple[StateEntry, ...]  # what the target flat parameter's state holds
    segments: tuple[Segment, ...]  # cover [0, numel) of the target flat parameter


@dataclass(frozen=True)
class RecutPlan:
    groups: tuple[GroupRecord, ...]  # hyperparameters from the checkpoint, members are target flat indices
    flats: Mapping[int, FlatPlan]  # target flat index -> plan, only for flat parameters with state
    identity: bool  # same flat parameters at the same world size: rank r needs rank file r only


def at_rank(layout: ModelLayout, rank: int) -> ModelLayout:
    """``layout`` as rank ``rank`` sees it (units that are not sharded stay at rank 0)."""
    flats = tuple(replace(f, rank=rank if f.world_size > 1 else 0) for f in layout.flat_params)
    return replace(layout, flat_params=flats, rank=rank)


def plan_recut(
    manifest: Manifest,
    target: ModelLayout,
    target_groups: Sequence[Sequence[int]] | None = None,
    *,
    source: str = "checkpoint",
) -> RecutPlan:
    """Check that ``manifest`` fits ``target`` and plan every target flat parameter's state.

    Args:
        manifest: the saved checkpoint.
        target: the layout to cut for (any world size, any nesting of the same parameters).
        target_groups: target flat indices per param group of the optimizer that will load the state,
            in its order; ``None`` takes the checkpoint's groups (members sorted by target index).
        source: names the checkpoint in errors.

    Raises ``ValueError`` naming the parameter, with what was expected and what was found.
    """
    target.check_world_sizes()
    where = {spec.name: (i, spec) for i, flat in enumerate(manifest.flat_params) for spec in flat.params}
    group_of = {i: k for k, g in enumerate(manifest.groups) for i in g.flat_indices}
    target_names = {spec.name for flat in target.flat_params for spec in flat.params}
    extra = sorted(set(where) - target_names)
    if extra:
        raise ValueError(
            f"{source} has parameter '{extra[0]}' (and {len(extra) - 1} more), which the model does not have"
        )
    if target_groups is not None and len(target_groups) != len(manifest.groups):
        raise ValueError(
            f"the optimizer has {len(target_groups)} param groups but {source} has {len(manifest.groups)}"
        )
    live_group = {i: k for k, members in enumerate(target_groups or []) for i in members}

    flats: dict[int, FlatPlan] = {}
    derived: list[list[int]] = [[] for _ in manifest.groups]
    for t, flat in enumerate(target.flat_params):
        missing = [spec.name for spec in flat.params if spec.name not in where]
        in_optimizer = t in live_group
        if missing:
            if in_optimizer:
                raise ValueError(f"parameter '{missing[0]}' of {flat.describe()} is missing from {source}")
            continue
        segments: list[Segment] = []
        used: list[int] = []
        for spec in flat.params:
            s, saved = where[spec.name]
            if saved.shape != spec.shape:
                raise ValueError(
                    f"parameter '{spec.name}' has shape {spec.shape} in the model but {saved.shape} in {source}"
                )
            if s not in used:
                used.append(s)
            last = segments[-1] if segments else None
            if last is not None and last.source == s and last.source_start + last.stop - last.start == saved.offset:
                segments[-1] = replace(last, stop=last.stop + spec.numel)
            else:
                segments.append(Segment(spec.offset, spec.offset + spec.numel, s, saved.offset))
        groups = {group_of.get(s) for s in used}
        if len(groups) > 1:
            detail = ", ".join(f"'{manifest.flat_params[s].params[0].name}' in group {group_of.get(s)}" for s in used)
            raise ValueError(f"{source} splits {flat.describe()} over param groups: {detail}")
        group = groups.pop()
        if target_groups is None:
            if group is not None:
                derived[group].append(t)
        elif group != live_group.get(t):
            name = flat.params[0].name
            saved_in = "no param group" if group is None else f"param group {group}"
            live_in = "no param group" if t not in live_group else f"group {live_group[t]}"
            raise ValueError(f"parameter '{name}' is in {saved_in} of {source} but in {live_in} of the optimizer")
        entries = _merge_entries(manifest, flat.describe(), used, dtype_to_str(flat.dtype), source)
        if entries:
            flats[t] = FlatPlan(entries, tuple(segments))

    members = derived if target_groups is None else [list(m) for m in target_groups]
    groups_out = tuple(
        GroupRecord(g.hyperparams, tuple(m), g.named) for g, m in zip(manifest.groups, members, strict=True)
    )
    identity = manifest.world_size == target.world_size and len(manifest.flat_params) == len(target.flat_params)
    identity = identity and all(
        s.params == t.params and s.world_size == t.world_size and s.dtype == dtype_to_str(t.dtype)
        for s, t in zip(manifest.flat_params, target.flat_params)
    )
    return RecutPlan(groups_out, flats, identity)


def _merge_entries(
    manifest: Manifest, label: str, used: Sequence[int], dtype: str, source: str
) -> tuple[StateEntry, ...]:
    """The state entries of a target flat parameter made of source flats ``used``; they must agree."""
    records = [manifest.flat_params[s] for s in used]
    with_state = [r for r in records if r.state]
    if not with_state:
        return ()
    if len(with_state) != len(records):
        lacking = next(r for r in records if not r.state)
        raise ValueError(
            f"parameter '{lacking.params[0].name}' has no optimizer state in {source} but "
            f"'{with_state[0].params[0].name}' has, and the model puts both in {label}"
        )
    first = with_state[0]
    for other in with_state[1:]:
        if {e.key for e in other.state} != {e.key for e in first.state}:
            raise ValueError(
                f"parameter '{other.params[0].name}' has state keys {sorted(e.key for e in other.state)} in {source}, "
                f"expected {sorted(e.key for e in first.state)} like '{first.params[0].name}' of the same {label}"
            )
    for e in first.state:
        for other in with_state:
            o = other.entry(e.key)
            if e.kind is StateKind.SHARDED:
                if o.kind is not StateKind.SHARDED or o.dtype != dtype:
                    found = o.dtype if o.kind is StateKind.SHARDED else "a scalar"
                    raise ValueError(
                        f"optimizer state '{e.key}' of parameter '{other.params[0].name}' is {found} in {source}, "
                        f"expected {dtype} (the parameter's dtype in the model)"
                    )
            elif o.kind is not StateKind.SCALAR or not same_scalar(e.value, o.value):
                found = show_value(o.value) if o.kind is StateKind.SCALAR else "a tensor"
                raise ValueError(
                    f"scalar optimizer state '{e.key}' differs inside {label}: '{first.params[0].name}' has "
                    f"{show_value(e.value)}, '{other.params[0].name}' has {found}; one flat parameter holds one value"
                )
    return first.state


def recut_rank_state(
    plan: RecutPlan,
    target: ModelLayout,
    read: Reader,
    *,
    after_unit: Callable[[], None] | None = None,
) -> dict[int, dict[str, Any]]:
    """One rank's state, ``{target flat index: {key: padded shard or scalar}}``, for ``target``'s rank.

    Each shard is new memory of ``ceil(numel / world_size)`` elements; only the source elements that
    land in it are read. ``after_unit`` runs after each flat parameter (to release file mappings).
    """
    out: dict[int, dict[str, Any]] = {}
    for t, flat_plan in plan.flats.items():
        flat = target.flat_params[t]
        bounds = flat.bounds()
        entries: dict[str, Any] = {}
        for e in flat_plan.entries:
            if e.kind is StateKind.SCALAR:
                entries[e.key] = clone_value(e.value)
                continue
            shard = torch.zeros(bounds.numel, dtype=dtype_from_str(e.dtype, where=flat.describe()))  # type: ignore[arg-type]
            for seg in flat_plan.segments:
                lo, hi = max(seg.start, bounds.start), min(seg.stop, bounds.stop)
                if lo < hi:
                    start = seg.source_start + lo - seg.start
                    read(seg.source, e.key, start, start + hi - lo, shard[lo - bounds.start : hi - bounds.start])
            entries[e.key] = shard
        out[t] = entries
        if after_unit is not None:
            after_unit()
    return out
