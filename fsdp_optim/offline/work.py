"""A verb's reading cut into pieces, in the order of its report: ``verify --deep``'s findings and ``diff``'s rows.

A :class:`Piece` is the bytes it reads and the function that reads them and returns its part of the report; a
:class:`Work` is the pieces and how their parts make the report. One process runs every piece in order
(:func:`run_work`); a team splits them by bytes into contiguous runs and puts the parts back in the same order
(:mod:`fsdp_optim.offline.parallel.shared`), so both make the same report by construction::

    pieces   [settings: 0 B] [embed.weight exp_avg: 264 B] [embed.weight exp_avg_sq: 264 B] ... [side files: 0 B]
    one      run_work(work)                every part, in order
    a team   process p runs split_by_bytes(sizes, P).runs[p]; process 0 concatenates the parts in rank order

A piece that reads no tensor (settings, scalars, what is on one side only, the checks against a layout) weighs
0 bytes; :func:`~fsdp_optim.core.split.split_by_bytes` gives it to the process whose share its position falls in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind
from fsdp_optim.offline.per_param import PerParameter

__all__ = ["Piece", "Work", "run_work", "state_bytes"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Piece(Generic[T]):
    """``run()``: this piece's part of the report, reading about ``nbytes`` bytes of state; ``reads``: the state
    tensor it reads, ``(parameter, key)`` (``None``: a part that reads no tensor of the source's state)."""

    nbytes: int
    run: Callable[[], Sequence[T]]
    reads: tuple[str, str] | None = None


@dataclass(frozen=True)
class Work(Generic[T, R]):
    """A verb's reading: its ``pieces`` in the report's order, and ``report``, which makes the report of their parts
    (from what was known before any piece ran: labels, settings, counts)."""

    pieces: Sequence[Piece[T]]
    report: Callable[[tuple[T, ...]], R]


def run_work(work: Work[T, R]) -> R:
    """The report one process makes: every piece run in order."""
    return work.report(tuple(part for piece in work.pieces for part in piece.run()))


def state_bytes(view: PerParameter, name: str, key: str) -> int:
    """The bytes of state ``key`` of parameter ``name`` (0 for a scalar, or a key the parameter lacks)."""
    entry = view.entries(name).get(key)
    if entry is None or entry.kind is not StateKind.SHARDED or entry.dtype is None:
        return 0
    numel = view.plan.target.flat_params[view.index[name]].params[0].numel
    return numel * dtype_from_str(entry.dtype, where=f"{view.label}, '{name}' state '{key}'").itemsize
