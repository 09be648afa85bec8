"""Executors of a plan: one rank's padded shards (:func:`cut_rank`), the whole flat tensors (:func:`assemble_full`).

They only copy; every check happened in :func:`fsdp_optim.core.plan.plan`. A rank's work is found by
interval lookup, never by walking every (unit, rank) pair: its real elements of a unit are two ints
(:class:`~fsdp_optim.core.intervals.ShardIndex`), the segments that overlap them a bisection of the
unit's sorted segments, and the saved ranks holding those elements one division each
(:func:`~fsdp_optim.core.intervals.rank_range`). Planning one rank of a 4,096-rank job with 1,000 units
so costs ``O(units * log(segments))``, not ``O(units * ranks)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.intervals import overlapping, rank_range
from fsdp_optim.core.source import FlatPlan, Plan, Reader, Segment

__all__ = [
    "Read",
    "assemble_full",
    "cut_rank",
    "optimizer_state_dict",
    "rank_reads",
    "read_ranges",
    "restrict",
    "saved_ranks",
]


@dataclass(frozen=True)
class Read:
    """Elements ``[start, stop)`` of a rank's shard of target flat ``flat`` are source flat ``source``'s elements
    from ``source_start`` on (full, unpadded offsets in the source; offsets in the rank's padded shard here)."""

    flat: int
    start: int
    stop: int
    source: int
    source_start: int


def _reads(flat: int, segments: Sequence[Segment], start: int, stop: int) -> Iterator[Read]:
    """The copies that fill real elements ``[start, stop)`` of a target flat, at offsets from ``start``."""
    for i in overlapping(segments, start, stop):
        seg = segments[i]
        lo, hi = max(seg.start, start), min(seg.stop, stop)
        if lo < hi:
            yield Read(flat, lo - start, hi - start, seg.source, seg.source_start + lo - seg.start)


def rank_reads(plan: Plan, rank: int) -> tuple[Read, ...]:
    """Every copy that builds rank ``rank``'s state, unit by unit: what planning one rank amounts to."""
    out: list[Read] = []
    for t, flat_plan in plan.flats.items():
        start, stop, _ = plan.shards.bounds(t, rank)
        out.extend(_reads(t, flat_plan.segments, start, stop))
    return tuple(out)


def saved_ranks(plan: Plan, rank: int) -> list[int]:
    """The saved ranks (rank files of a sharded source) that rank ``rank``'s reads touch, sorted (a per-rank source
    flat's at ``rank`` itself)."""
    index = plan.source_shards
    found: set[int] = set()
    for read in rank_reads(plan, rank):
        s = read.source
        if index.per_rank[s]:
            found.add(rank)
            continue
        first = read.source_start
        found.update(rank_range(index.numel[s], index.world_size[s], first, first + read.stop - read.start))
    return sorted(found)


def read_ranges(plan: Plan, rank: int) -> Iterator[tuple[int, str, int, int]]:
    """``(source flat, state key, start, stop)`` of every read :func:`cut_rank` makes for rank ``rank`` (full,
    unpadded offsets in the source), in its order: what it will read, found without reading anything."""
    for t, group in groupby(rank_reads(plan, rank), key=lambda r: r.flat):
        reads = tuple(group)
        for e in plan.flats[t].entries:
            if e.kind is not StateKind.SCALAR:
                yield from ((r.source, e.key, r.source_start, r.source_start + r.stop - r.start) for r in reads)


def cut_rank(plan: Plan, rank: int, *, after_unit: Callable[[], None] | None = None) -> dict[int, dict[str, Any]]:
    """Rank ``rank``'s state ``{target flat index: {key: padded shard or scalar}}``, new memory: only the source
    elements in the rank's slice are read. ``after_unit`` runs after each flat (to release file mappings)."""
    bounds = lambda t: plan.shards.bounds(t, rank)  # noqa: E731
    return _fill(plan, list(plan.flats), bounds, plan.source.reader(rank), after_unit)


def assemble_full(
    plan: Plan, *, after_unit: Callable[[], None] | None = None, per_rank: int | None = None
) -> dict[int, dict[str, Any]]:
    """Every target flat's full state ``{target flat index: {key: flat tensor (numel,) or scalar}}``, new memory:
    shared flats only by default; with ``per_rank=r``, only the per-rank flats, as rank ``r`` holds them."""
    read = plan.source.read if per_rank is None else plan.source.reader(per_rank)
    flats = [t for t in plan.flats if plan.target.flat_params[t].per_rank == (per_rank is not None)]
    return _fill(plan, flats, lambda t: (0, plan.shards.numel[t], 0), read, after_unit)


def _fill(
    plan: Plan,
    flats: Sequence[int],
    bounds: Callable[[int], tuple[int, int, int]],
    read: Reader,
    after_unit: Callable[[], None] | None,
) -> dict[int, dict[str, Any]]:
    """Each of ``flats``' real elements ``[start, stop)`` then ``padding`` zeros (``bounds(flat)``), per state key."""
    out: dict[int, dict[str, Any]] = {}
    for t in flats:
        flat_plan = plan.flats[t]
        start, stop, padding = bounds(t)
        reads = tuple(_reads(t, flat_plan.segments, start, stop))
        entries: dict[str, Any] = {}
        for e in flat_plan.entries:
            if e.kind is StateKind.SCALAR:
                entries[e.key] = clone_value(e.value)
                continue
            # Segments tile the flat, so each real element is written once; only the padding needs zeros.
            shard = torch.empty(stop - start + padding, dtype=dtype_from_str(e.dtype, where=e.key))
            shard[stop - start :].zero_()
            for r in reads:
                read(r.source, e.key, r.source_start, r.source_start + r.stop - r.start, shard[r.start : r.stop])
            entries[e.key] = shard
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


def optimizer_state_dict(plan: Plan, state: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """``{target flat: entries}`` -> what ``optim.load_state_dict`` takes; ids follow the plan's groups.

    ``{"state": {local_id: {key: shard or scalar}}, "param_groups": [{...hyperparams, "params": [local_id]}]}``

    A shard is in the live shard's shape (:attr:`~fsdp_optim.core.layout.FlatParamLayout.shard_shape`): 1-D, or a
    view in the parameter's own shape for one that fairscale keeps unflattened at world size 1.
    """
    out_state: dict[int, Any] = {}
    out_groups = []
    next_id = 0
    for group in plan.groups:
        ids = []
        for t in group.flat_indices:
            if t in state:
                out_state[next_id] = _live_shaped(plan, t, state[t])
            ids.append(next_id)
            next_id += 1
        out_groups.append({**{k: clone_value(v) for k, v in group.hyperparams.items()}, "params": ids})
    return {"state": out_state, "param_groups": out_groups}


def _live_shaped(plan: Plan, flat: int, entries: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of one target flat's ``entries`` with every sharded tensor viewed in the live shard's shape."""
    shape = plan.target.flat_params[flat].shard_shape
    sharded = {e.key for e in plan.flats[flat].entries if e.kind is StateKind.SHARDED}
    return {
        key: value.view(shape) if key in sharded and tuple(value.shape) != shape else value
        for key, value in entries.items()
    }
