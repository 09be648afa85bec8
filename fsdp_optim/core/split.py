"""Which process of an offline job writes which output: the outputs (rank files, in rank order) split by bytes into
contiguous runs, one per process. Pure: every process computes the same split from the same sizes, so nothing is
sent but the sizes' source (the plan, which every process makes alike). Two splits:

- :func:`split_stream`: the outputs' data as one stream of bytes cut into equal shares at chunk boundaries, a file
  written by several processes where a cut falls inside it (each writes its bytes at their offsets); shares within
  one chunk of each other, whatever the number of files and processes;
- :func:`split_by_bytes`: whole outputs per process (files checked or written whole).

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

__all__ = ["Split", "Stretch", "StreamSplit", "split_by_bytes", "split_stream"]


@dataclass(frozen=True)
class Split:
    """Outputs per process: ``runs[p]`` the output indices process ``p`` writes (contiguous, in order), and
    ``nbytes[p]`` their bytes."""

    runs: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]

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


@dataclass(frozen=True)
class Stretch:
    """Data bytes ``[start, stop)`` of output ``output`` (offsets in its data, the header not counted)."""

    output: int
    start: int
    stop: int


@dataclass(frozen=True)
class StreamSplit:
    """``outputs`` outputs of ``file_bytes`` data bytes each, read as one stream (output 0's data, then output
    1's, ...) and cut at ``cuts`` (``processes + 1`` stream offsets, from 0 to the end): process ``p`` writes
    stream bytes ``[cuts[p], cuts[p + 1])``. The *owner* of an output (the process whose share holds its first
    data byte; by count when outputs hold no data) lays it out and finishes it::

        3 outputs of 100 bytes, 2 processes: cuts (0, 150, 300)
        process 0: output 0 [0, 100), output 1 [0, 50)      owns outputs 0, 1
        process 1: output 1 [50, 100), output 2 [0, 100)    owns output 2
    """

    outputs: int
    file_bytes: int
    cuts: tuple[int, ...]

    @property
    def nbytes(self) -> tuple[int, ...]:
        """Each process's data bytes."""
        return tuple(b - a for a, b in zip(self.cuts, self.cuts[1:]))

    def spread(self) -> float:
        """The largest relative distance of a process's bytes from the mean (0.0: perfectly even)."""
        return Split((), self.nbytes).spread()

    def stretches(self, process: int) -> tuple[Stretch, ...]:
        """Process ``process``'s share, one :class:`Stretch` per output it writes into, in order."""
        lo, hi, d = self.cuts[process], self.cuts[process + 1], self.file_bytes
        out = []
        while lo < hi:
            o = lo // d
            stop = min(hi, (o + 1) * d)
            out.append(Stretch(o, lo - o * d, stop - o * d))
            lo = stop
        return tuple(out)

    def owned(self, process: int) -> range:
        """The outputs ``process`` owns (a contiguous run, maybe empty)."""
        processes, d = len(self.cuts) - 1, self.file_bytes
        if d == 0:
            return range(-(-process * self.outputs // processes), -(-(process + 1) * self.outputs // processes))
        return range(-(-self.cuts[process] // d), min(-(-self.cuts[process + 1] // d), self.outputs))


def split_stream(outputs: int, tensors: Sequence[tuple[int, int]], processes: int) -> StreamSplit:
    """``outputs`` outputs alike, each's data the ``tensors`` ``(bytes, chunk bytes)`` one after another, split over
    ``processes`` (see :class:`StreamSplit`): cut ``p`` is the chunk boundary (or tensor end) nearest to
    ``p / processes`` of the stream, so no chunk is cut and a process's bytes are within a chunk of the mean each
    side."""
    if processes < 1:
        raise ValueError(f"processes: expected at least 1, found {processes}")
    if outputs < 0 or any(n < 0 or c < 1 for n, c in tensors):
        raise ValueError(f"expected outputs >= 0 and tensors of bytes >= 0, chunks >= 1, found {outputs}, {tensors}")
    d = sum(n for n, _ in tensors)
    total = outputs * d
    cuts = [0]
    for p in range(1, processes):
        at = p * total // processes
        o = at // d if d else 0
        cuts.append(o * d + _snap(tensors, at - o * d))
    cuts.append(total)
    return StreamSplit(outputs, d, tuple(cuts))


def _snap(tensors: Sequence[tuple[int, int]], x: int) -> int:
    """The chunk boundary or tensor end nearest to data offset ``x`` of one output (non-decreasing in ``x``)."""
    base = 0
    for n, chunk in tensors:
        if x < base + n:
            k = (2 * (x - base) + chunk) // (2 * chunk)  # the nearest multiple of chunk (a half: up)
            return base + min(k * chunk, n)
        base += n
    return base
