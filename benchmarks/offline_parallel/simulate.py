"""The planner at cluster scale, no data: a metaseq-like checkpoint (992 rank files, 97 FSDP units: 96 layers and
the embeddings, Adam's ``exp_avg`` / ``exp_avg_sq`` and fp32 weights, 2.8 TB) re-cut for ``W'`` ranks by ``P``
processes. What one process of the real run computes: the plan (``core.plan.plan``), the split of the output rank
files (``core.split.split_by_bytes``) and each output rank's reads (``core.plan.read_ranges``), for every process.

Reported per case: planning seconds (the plan, the split, and the reads of the process with the most outputs), the largest distance of a
process's bytes from the mean, whether any input range is assigned to two processes (units stored whole, read by
all, aside), and the planned per-process memory: the largest shard one output rank cuts at a time (``streamed.py``
holds one) plus the reader's mapping bound and the writer's and checker's 8 MiB pieces.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import Source, plan, read_ranges
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES

SAVED_RANKS = 992
TOTAL_BYTES = 2.8e12
UNITS = 97  # 96 layers and the embeddings
KEYS = ("@param", "exp_avg", "exp_avg_sq")  # fp32 each
PIECE = 8 << 20  # the writer's and the checker's pieces
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


def case(new_world_size: int, processes: int) -> dict[str, Any]:
    """One simulated re-cut of the 992-file checkpoint to ``new_world_size`` ranks by ``processes`` processes."""
    source = _source()
    flats = _units(new_world_size)
    target = ModelLayout(flats, tuple(p.name for f in flats for p in f.params), new_world_size, 0)
    start = time.perf_counter()
    the_plan = plan(source, target)
    shard_numel = [the_plan.shards.bounds(t, 0)[1] - the_plan.shards.bounds(t, 0)[0] + the_plan.shards.bounds(t, 0)[2]
                   for t in range(len(flats))]  # fmt: skip
    file_bytes = sum(n * 4 * len(KEYS) for n in shard_numel)
    split = split_by_bytes([file_bytes] * new_world_size, processes)
    busiest = max(range(processes), key=lambda p: len(split.runs[p]))
    mine = [read for rank in split.runs[busiest] for read in read_ranges(the_plan, rank)]
    seconds = time.perf_counter() - start  # what one process plans: the plan, the split, its own reads
    reads: dict[tuple[int, str], list[tuple[int, int, int]]] = defaultdict(list)
    for p, run in enumerate(split.runs):  # every process's reads, to check that none overlaps another's
        for rank in run:
            for flat, key, a, b in read_ranges(the_plan, rank):
                reads[(flat, key)].append((a, b, p))
    assert len(mine) == sum(1 for spans in reads.values() for s in spans if s[2] == busiest), "the same reads"
    twice = 0
    for spans in reads.values():
        spans.sort()
        twice += sum(1 for (_, b0, _), (a1, _, _) in zip(spans, spans[1:]) if a1 < b0)
    memory = max(shard_numel) * 4 + DEFAULT_MAPPED_BYTES + 2 * PIECE
    return {
        "case": f"992 -> {new_world_size} ranks, {processes} processes", "saved_ranks": SAVED_RANKS,
        "new_world_size": new_world_size, "processes": processes, "state_bytes": file_bytes * new_world_size,
        "plan_seconds": seconds, "spread": split.spread(), "ranges_twice": twice, "memory_bytes": memory,
        "bytes_min": min(split.nbytes), "bytes_max": max(split.nbytes),
    }  # fmt: skip


def cases() -> list[dict[str, Any]]:
    """The cases of the results file: 1024 output ranks (a multiple of both process counts) and 992 (the saved
    world size, which 512 processes cannot share evenly by whole files)."""
    return [case(w, p) for w in (1024, 992) for p in (64, 512)]
