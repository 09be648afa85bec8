"""Which process of an offline job writes which output: the outputs (rank files, in rank order) split by bytes into
contiguous runs, one per process. Pure: every process computes the same split from the same sizes, so nothing is
sent but the sizes' source (the plan, which every process makes alike). Two splits:

- :func:`split_stream`: the outputs' data as one stream of bytes cut into equal shares at chunk boundaries, a file
  written by several processes where a cut falls inside it (each writes its bytes at their offsets); shares within
  one chunk of each other, whatever the number of files and processes;
- :func:`split_by_bytes`: whole outputs per process (files checked or written whole);
- :func:`plan_parts`: the parts of one multipart upload each process puts (the last section below).

Contiguous runs, not a greedy largest-first packing: output rank ``r`` of a re-cut reads the input elements
``[r * c', (r + 1) * c')`` of every unit, so neighbouring outputs read neighbouring input bytes, and a run of them
reads one stretch of each input file; two processes share at most the chunk where their runs meet. Each output goes
to the process in whose equal share of the total bytes its middle falls, so a process's bytes differ from the mean
by at most one output's size::

    sizes [4, 4, 4] over 2 processes: total 12, shares [0, 6) and [6, 12)
    middles 2, 6, 10 -> processes 0, 1, 1          runs ((0,), (1, 2))

:func:`plan_parts` cuts one file laid out up front into the parts of one multipart upload. An object store's
multipart upload has rules a file system's positional writes do not (S3's, which SeaweedFS enforces too): parts are
numbered from 1 in file order, each part is one request of contiguous bytes, and every part but the last is at least
``MIN_PART_BYTES``. So:

- process ``p`` uploads the bytes of its run of tensors, which are contiguous in the file; process 0's range starts
  at byte 0, the header's room, whose bytes it uploads last (the header holds every tensor's checksums);
- a process whose range is below the minimum takes the next process's tensors too (and the next, until it reaches
  the minimum), so that only the file's last range may be short; the processes it took from upload nothing;
- each range is cut into ``ceil(len / part_bytes)`` parts of equal size (so each is over ``part_bytes / 2``)::

      header 1 KiB, tensors of 40, 3 and 30 MiB over 3 processes, part_bytes 32 MiB, minimum 5 MiB
      ranges  [0, 40M+1K)  [40M+1K, 43M+1K)  [43M+1K, 73M+1K)    process 1's 3 MiB < 5 MiB: it takes process 2's
      parts   process 0: 1, 2 (20 MiB each)   process 1: 3, 4 (16.5 MiB each)   process 2: none
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_PARTS",
    "MIN_PART_BYTES",
    "PART_BYTES",
    "PartPlan",
    "PartSpan",
    "Split",
    "StreamSplit",
    "Stretch",
    "plan_parts",
    "split_by_bytes",
    "split_stream",
]


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


MIN_PART_BYTES = 5 << 20  # S3's least size of a part that is not the last
MAX_PARTS = 10_000  # S3's most parts of one upload
PART_BYTES = 64 << 20  # the default part: one request, and one buffer in a writer's memory


@dataclass(frozen=True)
class PartSpan:
    """Part ``number`` (from 1, in file order): the file's bytes ``[start, stop)``."""

    number: int
    start: int
    stop: int


@dataclass(frozen=True)
class PartPlan:
    """Per process: the tensors it writes (``runs[p]``, contiguous, in file order) and the parts it uploads
    (``parts[p]``, covering exactly its tensors' bytes, and the header's room on process 0)."""

    runs: tuple[tuple[int, ...], ...]
    parts: tuple[tuple[PartSpan, ...], ...]


def plan_parts(
    offsets: Sequence[int], nbytes: Sequence[int], size: int, runs: Sequence[Sequence[int]], *,
    part_bytes: int = PART_BYTES,
) -> PartPlan:  # fmt: skip
    """The parts of a file of ``size`` bytes whose tensor ``i`` lies at ``offsets[i]`` (``nbytes[i]`` long, in file
    order, the header before the first), written by processes whose tensors are ``runs`` (a split in file order);
    see the module docstring. ``part_bytes`` grows where the file would need more than ``MAX_PARTS`` parts."""
    if part_bytes < 2 * MIN_PART_BYTES:
        least = 2 * MIN_PART_BYTES
        raise ValueError(f"part_bytes: expected at least twice the least part ({least}), found {part_bytes}")
    part_bytes = max(part_bytes, -(-size // (MAX_PARTS // 2)))  # (equal cuts round up: half the maximum is safe)
    header = offsets[0] if offsets else size
    groups: list[tuple[int, list[int], int, int]] = [(0, [], 0, header)]  # (process, tensors, start, stop)
    for p, run in enumerate(runs):
        if not run:
            continue
        stop = offsets[run[-1]] + nbytes[run[-1]]
        owner, tensors, start, _ = groups[-1]
        if p == 0 or groups[-1][3] - start < MIN_PART_BYTES:  # the range before it is short: it takes these too
            groups[-1] = (owner, [*tensors, *run], start, stop)
        else:
            groups.append((p, list(run), offsets[run[0]], stop))
    if groups[-1][3] != size:
        raise ValueError(f"the runs cover bytes up to {groups[-1][3]} of a file of {size}")
    out_runs: list[tuple[int, ...]] = [() for _ in runs] or [()]
    out_parts: list[tuple[PartSpan, ...]] = [() for _ in out_runs]
    number = 1
    for owner, tensors, start, stop in groups:
        count = max(1, -(-(stop - start) // part_bytes))
        bounds = [start + k * (stop - start) // count for k in range(count + 1)]
        out_runs[owner] = tuple(tensors)
        out_parts[owner] = tuple(PartSpan(number + k, a, b) for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
        number += count
    return PartPlan(tuple(out_runs), tuple(out_parts))
