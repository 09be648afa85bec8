"""Which bytes of which files of a whole checkpoint one rank's load reads: its plans turned into byte ranges.

A load at the saved layout reads its own rank file whole; a re-cut reads, per unit and state key, the elements of
the saved shards that overlap its own (:func:`fsdp_optim.core.execute.read_ranges`), each run widened to the
chunks it touches, so a peer that receives exactly these ranges and the file's header (which holds the checksums)
can verify every byte it reads::

    rank file f of 2 x 64 KiB chunks of float32 after a 96-byte header; a read of elements 10..20000 ->
    [("f", 0, 96), ("f", 96, 96 + 2 * 65536)]      # the header, then chunks 0 and 1 (elements 0..32768)

Where tensors lie comes from the manifest alone (the header is what the file's size leaves before the data). Side
files are read whole; formats 1 and 2: every file read whole. Pure: no file is opened.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.execute import read_ranges, saved_ranks
from fsdp_optim.core.source import Plan
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.segments import chunk_elements
from fsdp_optim.formats.sharded.side_file import OWN, side_ranks

__all__ = ["Span", "cut_spans", "join_overlapping", "load_spans", "read_spans"]


class Span(NamedTuple):
    """Bytes ``[start, stop)`` of file ``file`` that a load reads, and how many of its reads of rank-file shards fall
    in them (``uses``; 0 for a header or a side file, which are read in other ways)."""

    file: str
    start: int
    stop: int
    uses: int


def load_spans(
    ckpt: ShardedCheckpoint, weights: Plan, optim: Plan | None, rank: int, *, buffers: str = OWN
) -> list[Span]:
    """The byte ranges of the checkpoint's files that rank ``rank``'s load reads, given its weights and optimizer
    plans (``optim`` None: the model alone) and the rule that finds its buffers (:func:`.side_file.side_ranks`): its
    rank files' (chunk-aligned, headers included) and side files', in the order the load first uses them (so that a
    peer sending them in that order lets it start at once), each with the number of shard reads it serves."""
    manifest = ckpt.manifest
    names = {f.rank: f for f in manifest.files}
    out: list[Span] = []
    if weights.identity:
        out.append(Span(names[rank].file, 0, names[rank].nbytes, 0))
    elif manifest.version < 3:
        touched = set(saved_ranks(weights, rank) or [0]) | (set(saved_ranks(optim, rank)) if optim else set())
        out.extend(Span(names[r].file, 0, names[r].nbytes, 0) for r in sorted(touched))
    else:
        reads = [*read_ranges(weights, rank), *(read_ranges(optim, rank) if optim is not None else ())]
        out.extend(_rank_file_ranges(ckpt, ((rank, read) for read in reads)))
    training = manifest.training
    if training is None:  # (a plan of the weights refuses such a checkpoint first; this keeps -O honest)
        raise ValueError(f"{ckpt.directory}: an optimizer-only checkpoint (no training section): no weights to restore")
    sides = side_ranks(training, manifest.world_size, rank % manifest.world_size, buffers)
    out.extend(Span(training.side_file(r).file, 0, training.side_file(r).nbytes, 0) for r in sides)
    return out


def cut_spans(ckpt: ShardedCheckpoint, the_plan: Plan, ranks: Iterable[int]) -> list[Span]:
    """The rank-file ranges that cutting ``ranks`` one after another reads (an offline re-cut), headers included, in
    order of first use, each with its number of shard reads; format 3 only (else none)."""
    return read_spans(ckpt, ((rank, read) for rank in ranks for read in read_ranges(the_plan, rank)))


def read_spans(ckpt: ShardedCheckpoint, reads: Iterable[tuple[int, tuple[int, str, int, int]]]) -> list[Span]:
    """:func:`cut_spans` of any reads: ``(output rank reading, (source flat, state key, start, stop))`` each, in order
    of use; format 3 only (else none)."""
    return _rank_file_ranges(ckpt, reads) if ckpt.manifest.version >= 3 else []


def _rank_file_ranges(ckpt: ShardedCheckpoint, reads: Iterable[tuple[int, tuple[int, str, int, int]]]) -> list[Span]:
    """Format 3: each read's pieces in the rank files holding them, widened to whole chunks, and each file's header;
    merged per file, in order of first use (headers first), each with the number of pieces it holds."""
    where, sizes = ckpt.layout
    records = {f.rank: f for f in ckpt.manifest.files}
    itemsize = {t: dtype_from_str(t, where=str(ckpt.directory)).itemsize for t in sizes}
    ends = list(itertools.accumulate((n * itemsize[t] for t, n in sizes.items()), initial=0))
    data_at = dict(zip(sizes, ends))  # each tensor's byte offset after the header: the tensors in file order
    header = {r: f.nbytes - ends[-1] for r, f in records.items()}
    found: dict[int, list[tuple[int, int, int]]] = {}  # {file rank: [(start, stop, index of first use)]}
    for k, (rank, (flat, key, start, stop)) in enumerate(reads):
        tensor, offset, _ = where[(flat, key)]
        per, size = chunk_elements(dtype_from_str(tensor, where=tensor), ckpt.manifest.chunk_bytes), itemsize[tensor]
        for r, lo, hi, _ in ckpt.pieces(rank, flat, start, stop):
            file = ckpt.file_rank(r, flat)
            first, last = (offset + lo) // per * per, min(-(-(offset + hi) // per) * per, sizes[tensor])
            base = header[file] + data_at[tensor]
            found.setdefault(file, [(0, header[file], -1)]).append((base + first * size, base + last * size, k))
    merged = [(records[r].file, *span) for r, spans in found.items() for span in _join(spans)]
    ordered = sorted(merged, key=lambda m: (m[3], m[0], m[1]))
    return [Span(name, start, stop, uses) for name, start, stop, _, uses in ordered]


def join_overlapping(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Overlapping spans joined (a chunk is received once, whole), each keeping the first use of any of its parts.
    Touching ones stay apart: a piece is usable once all of it arrived, so a load can start on the first while
    the next is in flight."""
    return [(start, stop, use) for start, stop, use, _ in _join(spans)]


def _join(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """:func:`join_overlapping`, each joined span with the number of shard reads in it (uses >= 0; a header's -1
    counts none)."""
    out: list[tuple[int, int, int, int]] = []
    for start, stop, use in sorted(s for s in spans if s[1] > s[0]):
        if out and start < out[-1][1]:
            a, b, first, uses = out[-1]
            out[-1] = (a, max(b, stop), min(first, use), uses + (use >= 0))
        else:
            out.append((start, stop, use, int(use >= 0)))
    return out
