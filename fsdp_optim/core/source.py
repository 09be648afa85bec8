"""What the engine works on: a :class:`Source` of optimizer state, and the frozen :class:`Plan` it is checked into
(:mod:`fsdp_optim.core.plan` builds a plan, with a worked example; :mod:`fsdp_optim.core.execute` runs one).

For a sharded checkpoint the source flats are the saved FSDP units; for a full dict every parameter is a source flat
of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry

__all__ = ["FlatPlan", "Plan", "Reader", "Segment", "Source", "plan_error"]

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

    ``flats[i]`` are rank-independent records with their state entries; ``groups`` hold the hyperparameters and,
    per group, indices into ``flats``.
    """

    label: str  # names the source in errors: "the full dict", "/ckpt/step100"
    optimizer: str | None  # class name it was saved from; None when unknown
    flats: tuple[FlatRecord, ...]
    groups: tuple[GroupRecord, ...]
    read: Reader
    world_size: int | None = None  # the world size it was saved at, when that means anything
    # False: a parameter without state has an unknown shape (full dicts); state shapes are checked instead.
    shapes_known: bool = True
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
    """How to build every target flat's state. ``groups`` hold the source's hyperparameters and target flat indices;
    ``shards`` / ``source_shards`` the target's and the source's units as :class:`ShardIndex` ints."""

    source: Source
    target: ModelLayout
    groups: tuple[GroupRecord, ...]
    flats: Mapping[int, FlatPlan]  # target flat index -> plan, only for flats with state
    identity: bool  # same units at the same world size: rank r's state is saved rank r's, as it is
    shards: ShardIndex = field(default=ShardIndex((), (), ()), compare=False, repr=False)
    source_shards: ShardIndex = field(default=ShardIndex((), (), ()), compare=False, repr=False)
