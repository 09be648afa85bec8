"""Restoring a whole checkpoint from the memory tiers of the surviving nodes, at any world size and nesting.

1. Every rank reads what its node holds (complete steps: marker, manifest, files of their recorded sizes) and the
   reports are all-gathered; every rank then picks the same step, the newest whose every file is held by the node
   of some live rank (:func:`fsdp_optim.core.memory_plan.choose_step`), or None: nothing survived whole.
2. The manifest goes from the first holder to every rank; each node lacking the step gets it (its first rank).
3. Each rank plans its load (the same plans :func:`fsdp_optim.load_checkpoint` makes) to learn which saved ranks'
   files it reads; the files its node lacks are sent point to point, each once per node, whole, by a rank whose node
   holds it (:func:`~fsdp_optim.core.memory_plan.fetch_plan`), and written into that node's step directory.
4. Every rank loads from its node's step directory with :func:`fsdp_optim.load_checkpoint`: every byte it reads
   is verified against the chunk checksums and side-file digests, and all ranks load or all raise the same error.

Cost: two small all-gathers and a broadcast of the manifest, one agreement per phase, and one message per file
fetched (a file a node lacks crosses the network once, whole), then the load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.memory_plan import Chosen, Holding, choose_step, fetch_plan, node_ranks
from fsdp_optim.core.plan import plan, saved_ranks
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.memory_tier import read_holdings
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.job.memory_save import MemoryTier, file_bytes, write_file
from fsdp_optim.job.root import Root, verify_root
from fsdp_optim.job.transport import agree, all_gather_objects, broadcast_object, exchange_bytes
from fsdp_optim.job.whole_load import load_checkpoint

__all__ = ["MemoryRestore", "find_in_memory", "restore_from_memory"]


@dataclass(frozen=True)
class MemoryRestore:
    """What :func:`restore_from_memory` did: the newest step the memory tiers hold whole (None: none), over how
    many live nodes, and, when it loaded that step, this node's step directory and the step's ``extra``."""

    step: int | None
    nodes: int
    directory: Path | None
    extra: Any
    loaded: bool


def find_in_memory(root: Root, tier: MemoryTier) -> tuple[list[str], list[list[Holding]], Chosen | None]:
    """Step 1: every rank's node and holdings, and the step to restore (the same on every rank). One all-gather."""
    reports = all_gather_objects((tier.node, read_holdings(tier.node_dir())), root.group)
    holdings = [list(h) for _, h in reports]
    return [n for n, _ in reports], holdings, choose_step(holdings)


def restore_from_memory(
    model: nn.Module, optim: torch.optim.Optimizer | None, tier: MemoryTier, *, older_than_durable: int | None = None
) -> MemoryRestore:
    """Load the newest step the live nodes' memory tiers hold whole into ``model`` and ``optim``, unless none does
    or it is older than ``older_than_durable`` (the newest durable step: restore that instead); then nothing is
    changed and ``loaded`` is False. A collective: every rank gets the same answer, or raises the same error."""
    root = verify_root(model, optim)
    nodes, holdings, chosen = find_in_memory(root, tier)
    live = len(set(nodes))
    if chosen is None or (older_than_durable is not None and chosen.step < older_than_durable):
        return MemoryRestore(chosen.step if chosen is not None else None, live, None, None, loaded=False)
    directory = tier.node_dir() / chosen.dirname
    what = f"restoring step {chosen.step} from the memory tiers changed nothing on any rank"
    _spread_manifest(root, nodes, holdings, chosen, directory, what)
    needed, failure = None, None
    try:
        needed = needed_files(directory, root, optim)
    except Exception as exc:  # every rank learns of it through agree(), and nothing is changed anywhere
        failure = exc
    agree(failure, group=root.group, what=what)
    has = {nodes[r]: _held(h, chosen) for r, h in enumerate(holdings)}
    fetches = fetch_plan(chosen, nodes, all_gather_objects(sorted(needed or ()), root.group), has)
    sends = []
    try:
        sends = [(f.dst, file_bytes(directory / f.file)) for f in fetches if f.src == root.rank]
    except Exception as exc:
        failure = exc
    agree(failure, group=root.group, what=what)
    mine = [f for f in fetches if f.dst == root.rank]
    received = exchange_bytes(sends, [(f.src, f.nbytes) for f in mine], group=root.group)
    try:
        for fetch, data in zip(mine, received):
            write_file(directory / fetch.file, data)  # the node holds it now; checked when the load reads it
    except Exception as exc:
        failure = exc
    agree(failure, group=root.group, what=what)
    extra = load_checkpoint(model, optim, directory)
    return MemoryRestore(chosen.step, live, directory, extra, loaded=True)


def _held(report: list[Holding], chosen: Chosen) -> frozenset[str]:
    return next((h.held for h in report if (h.step, h.save_id) == (chosen.step, chosen.save_id)), frozenset())


def _spread_manifest(
    root: Root, nodes: list[str], holdings: list[list[Holding]], chosen: Chosen, directory: Path, what: str
) -> None:
    """Step 2: the manifest from the lowest holder rank to all; the first rank of each node lacking it writes it."""
    src = min(r for r, report in enumerate(holdings) if _holds_step(report, chosen))
    data = broadcast_object((directory / MANIFEST_NAME).read_bytes() if root.rank == src else None, src=src,
                            group=root.group)  # fmt: skip
    failure = None
    try:
        if node_ranks(nodes)[nodes[root.rank]][0] == root.rank and not (directory / MANIFEST_NAME).is_file():
            directory.mkdir(parents=True, exist_ok=True)
            write_file(directory / MANIFEST_NAME, data)
    except Exception as exc:
        failure = exc
    agree(failure, group=root.group, what=what)


def _holds_step(report: list[Holding], chosen: Chosen) -> bool:
    return any((h.step, h.save_id) == (chosen.step, chosen.save_id) for h in report)


def needed_files(directory: Path, root: Root, optim: torch.optim.Optimizer | None) -> set[str]:
    """The files of the checkpoint in ``directory`` that this rank's load reads: the rank files its weight and
    optimizer plans touch (its own at the saved layout) and its side files (its saved rank's, and rank 0's for
    the buffers unless they were saved per rank). Reads the manifest alone."""
    with ShardedCheckpoint(directory, lazy=True) as ckpt:
        manifest, rank = ckpt.manifest, root.rank
        everything = [list(range(len(root.layout.flat_params)))]
        weights = plan(ckpt.weights_source(), root.layout, members=everything)
        ranks = {rank} if weights.identity else set(saved_ranks(weights, rank) or [0])
        if optim is not None and manifest.optimizer is not None:
            state = plan(ckpt.source(), root.layout, members=root.members)
            ranks |= {rank} if state.identity else set(saved_ranks(state, rank))
        training = manifest.training
        assert training is not None, "weights_source() refuses a checkpoint without a training section"
        sides = {training.side_file(rank % manifest.world_size).file}
        sides |= set() if training.buffers_per_rank else {training.side_file(0).file}
    return {f.file for f in manifest.files if f.rank in ranks} | sides
