"""One file laid out up front, cut into the parts of one multipart upload: which process uploads which bytes. Pure:
every process computes the same parts from the same layout and split.

An object store's multipart upload has rules a file system's positional writes do not (S3's, which SeaweedFS
enforces too): parts are numbered from 1 in file order, each part is one request of contiguous bytes, and every
part but the last is at least ``MIN_PART_BYTES``. So:

- process ``p`` uploads the bytes of its run of tensors (``core/split.py``), which are contiguous in the file;
  process 0's range starts at byte 0, the header's room, whose bytes it uploads last (the header holds every
  tensor's checksums);
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

__all__ = ["MAX_PARTS", "MIN_PART_BYTES", "PART_BYTES", "PartPlan", "PartSpan", "plan_parts"]

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
    part_bytes: int = PART_BYTES, min_bytes: int = MIN_PART_BYTES,
) -> PartPlan:  # fmt: skip
    """The parts of a file of ``size`` bytes whose tensor ``i`` lies at ``offsets[i]`` (``nbytes[i]`` long, in file
    order, the header before the first), written by processes whose tensors are ``runs`` (a split in file order);
    see the module docstring. ``part_bytes`` grows where the file would need more than ``MAX_PARTS`` parts."""
    if part_bytes < 2 * min_bytes:
        raise ValueError(f"part_bytes: expected at least twice the least part ({2 * min_bytes}), found {part_bytes}")
    part_bytes = max(part_bytes, -(-size // (MAX_PARTS // 2)))  # (equal cuts round up: half the maximum is safe)
    header = offsets[0] if offsets else size
    groups: list[tuple[int, list[int], int, int]] = [(0, [], 0, header)]  # (process, tensors, start, stop)
    for p, run in enumerate(runs):
        if not run:
            continue
        stop = offsets[run[-1]] + nbytes[run[-1]]
        owner, tensors, start, _ = groups[-1]
        if p == 0 or groups[-1][3] - start < min_bytes:  # the range before it is short: it takes these too
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
