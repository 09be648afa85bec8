"""Which process of an offline job writes which output: the outputs (rank files, in rank order) split by bytes into
contiguous runs, one per process. Pure: every process computes the same split from the same sizes, so nothing is
sent but the sizes' source (the plan, which every process makes alike).

Contiguous runs, not a greedy largest-first packing: output rank ``r`` of a re-cut reads the input elements
``[r * c', (r + 1) * c')`` of every unit, so neighbouring outputs read neighbouring input bytes, and a run of them
reads one stretch of each input file; two processes share at most the chunk where their runs meet. Each output goes
to the process in whose equal share of the total bytes its middle falls, so a process's bytes differ from the mean
by at most one output's size::

    sizes [4, 4, 4] over 2 processes: total 12, shares [0, 6) and [6, 12)
    middles 2, 6, 10 -> processes 0, 1, 1          runs ((0,), (1, 2))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Split", "split_by_bytes"]


@dataclass(frozen=True)
class Split:
    """Outputs per process: ``runs[p]`` the output indices process ``p`` writes (contiguous, in order), and
    ``nbytes[p]`` their bytes."""

    runs: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]

    def owner(self, output: int) -> int:
        """The process that writes ``output``."""
        return next(p for p, run in enumerate(self.runs) if output in run)

    def spread(self) -> float:
        """The largest relative distance of a process's bytes from the mean (0.0: perfectly even)."""
        mean = sum(self.nbytes) / len(self.nbytes)
        return max(abs(n - mean) for n in self.nbytes) / mean if mean else 0.0


def split_by_bytes(sizes: Sequence[int], processes: int) -> Split:
    """``sizes[i]``: output ``i``'s bytes, split over ``processes`` processes (see the module docstring); a process
    may get nothing when there are fewer outputs than processes."""
    if processes < 1:
        raise ValueError(f"processes: expected at least 1, found {processes}")
    if any(n < 0 for n in sizes):
        raise ValueError(f"sizes: expected non-negative byte counts, found {min(sizes)}")
    total = sum(sizes)
    owners: list[int] = []
    at = 0
    for i, n in enumerate(sizes):
        if total:  # the share its middle falls in (2 * at + n over 2 * total, in integers)
            owners.append(min((2 * at + n) * processes // (2 * total), processes - 1))
        else:  # nothing to weigh: by count
            owners.append(i * processes // max(len(sizes), 1))
        at += n
    runs = tuple(tuple(i for i, o in enumerate(owners) if o == p) for p in range(processes))
    return Split(runs, tuple(sum(sizes[i] for i in run) for run in runs))
