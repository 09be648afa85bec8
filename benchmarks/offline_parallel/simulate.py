"""The planner at cluster scale, no data: a metaseq-like checkpoint (992 rank files, 97 FSDP units: 96 layers and
the embeddings, Adam's ``exp_avg`` / ``exp_avg_sq`` and fp32 weights, 2.8 TB) re-cut for ``W'`` ranks by ``P``
processes. What one process of the real run computes: the plan (``core.plan.plan``), the split of all the output
files' bytes (``core.split.split_stream``, cut on 64 KiB chunk boundaries), and its share as runs of chunks made of
shard pieces with their source reads (``offline/parallel/stretches.py``), for every process.

Reported per case: planning seconds (the plan, the split, and the share and reads of the process with the most
pieces), the largest distance of a process's bytes from the mean, how many source element ranges two processes
both read (units stored whole, read by all, aside), and the planned per-process memory: one piece (``PIECE_BYTES``)
plus the reader's mapping bound, the writer's 8 MiB read-back and the headers of the files it owns (about 46 bytes
per 64 KiB chunk each).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.source import Source
from fsdp_optim.core.split import split_stream
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES, file_layout
from fsdp_optim.offline.parallel.stretches import PIECE_BYTES, chunk_runs, piece_reads

SAVED_RANKS = 992
TOTAL_BYTES = 2.8e12
UNITS = 97  # 96 layers and the embeddings
KEYS = ("@param", "exp_avg", "exp_avg_sq")  # fp32 each
CHECK_BYTES = 8 << 20  # the writer reads each piece back in pieces of this
SLOT_BYTES = 46  # a chunk's digest in a header, with its quotes and comma
STATE = tuple(StateEntry(k, StateKind.SHARDED, dtype="float32") for k in KEYS) + (
    StateEntry("step", StateKind.SCALAR, value=1000),
)


def _units(world_size: int) -> tuple[FlatParamLayout, ...]:
    per_param = 4 * len(KEYS)
    numel = int(TOTAL_BYTES / per_param / UNITS)
    return tuple(
        FlatParamLayout(f"layers.{u}", (ParamSpec(f"layers.{u}.flat", (numel,), 0),), world_size, 0, torch.float32, True)
        for u in range(UNITS)
    )


def _source() -> Source:
    flats = tuple(FlatRecord.from_layout(f, STATE) for f in _units(SAVED_RANKS))
    groups = (GroupRecord({"lr": 1e-4}, tuple(range(len(flats)))),)
    return Source("metaseq-like", "Adam", flats, groups, lambda *a: None, SAVED_RANKS)


def _reads(the_plan: Any, runs: Any) -> list[tuple[int, str, int, int]]:
    return [(source, piece.key, first, last) for run in runs for piece in run.pieces
            for source, _, first, last in piece_reads(the_plan, run.rank, piece)]  # fmt: skip


def case(new_world_size: int, processes: int) -> dict[str, Any]:
    """One simulated re-cut of the 992-file checkpoint to ``new_world_size`` ranks by ``processes`` processes."""
    source = _source()
    flats = _units(new_world_size)
    target = ModelLayout(flats, tuple(p.name for f in flats for p in f.params), new_world_size, 0)
    start = time.perf_counter()
    the_plan = plan(source, target)
    shards = [(t, k, "float32", the_plan.shards.shard_numel(t)) for t in range(len(flats)) for k in KEYS]
    layout = file_layout(shards)
    split = split_stream(new_world_size, [(n * 4, CHUNK_BYTES) for n in layout[1].values()], processes)
    busiest = max(range(processes), key=lambda p: len(split.stretches(p)))
    mine = _reads(the_plan, chunk_runs(layout, split.stretches(busiest)))
    seconds = time.perf_counter() - start  # what one process plans: the plan, the split, its share and its reads
    reads: dict[tuple[int, str], list[tuple[int, int, int]]] = defaultdict(list)
    for p in range(processes):  # every process's reads, to check that no two processes read the same range
        for flat, key, a, b in _reads(the_plan, chunk_runs(layout, split.stretches(p))):
            reads[(flat, key)].append((a, b, p))
    assert len(mine) == sum(1 for spans in reads.values() for s in spans if s[2] == busiest), "the same reads"
    twice = 0
    for spans in reads.values():
        spans.sort()
        twice += sum(1 for (_, b0, p0), (a1, _, p1) in zip(spans, spans[1:]) if a1 < b0 and p0 != p1)
    file_bytes = split.file_bytes
    owned = max(len(split.owned(p)) for p in range(processes))
    header = -(-file_bytes // CHUNK_BYTES) * SLOT_BYTES
    memory = min(PIECE_BYTES, max(n for *_, n in shards) * 4) + DEFAULT_MAPPED_BYTES + CHECK_BYTES + (owned + 1) * header
    return {
        "case": f"992 -> {new_world_size} ranks, {processes} processes", "saved_ranks": SAVED_RANKS,
        "new_world_size": new_world_size, "processes": processes, "state_bytes": file_bytes * new_world_size,
        "plan_seconds": seconds, "spread": split.spread(), "ranges_twice": twice, "memory_bytes": memory,
        "bytes_min": min(split.nbytes), "bytes_max": max(split.nbytes),
    }  # fmt: skip


def cases() -> list[dict[str, Any]]:
    """The cases of the results file: 1024 output ranks (a multiple of both process counts) and 992 (the saved
    world size, which 512 processes could not share evenly by whole files)."""
    return [case(w, p) for w in (1024, 992) for p in (64, 512)]
