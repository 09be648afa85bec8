"""Restoring a whole checkpoint from the memory tiers of the surviving nodes, at any world size and nesting.

1. Every rank reads what its node holds (complete steps: marker, manifest, files of their recorded sizes) and the
   reports are all-gathered (one collective); every rank then picks the same step, the newest whose every file is
   held by the node of some live rank (:func:`fsdp_optim.core.memory_plan.choose_step`), or None.
2. A node lacking the step gets its manifest (one broadcast, only when some node lacks it).
3. Each rank opens the step in its node's directory and plans its load once (the plans
   :func:`fsdp_optim.load_checkpoint` makes); from the same plans it finds the byte ranges every rank's load
   reads (:func:`~fsdp_optim.formats.sharded.byte_ranges.load_spans`: chunk-aligned, headers included) and who
   sends which of those its node lacks (:func:`~fsdp_optim.core.memory_plan.fetch_plan`): no message needed.
   The ranks agree that planning went well everywhere.
4. Every receive and send is posted at once; each rank then loads, reading its node's files in place and the
   bytes it receives from memory as they arrive (the prefetch of :class:`~fsdp_optim.job.node_memory.NodeMemory`,
   the step's location), every chunk verified against its checksum before use; nothing received is written
   anywhere. The ranks agree, then every rank changes its model and optimizer, or none does.

A failure to read the step's bytes (a checksum mismatch, a file missing, a transfer that failed) raises
:class:`.node_memory.MemoryTierDamaged` on every rank, with nothing changed: the manager then restores from durable
storage.
Cost: one all-gather, two agreements, one message per byte range received (each byte a load reads from another
node crosses the network once, plus at most a chunk on each side of each range), then the load's own work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.memory_plan import Chosen, Fetch, Holding, choose_step, fetch_plan
from fsdp_optim.formats.sharded.byte_ranges import load_spans
from fsdp_optim.formats.sharded.memory_tier import read_holdings
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint, open_checkpoint
from fsdp_optim.job.agreed import step
from fsdp_optim.job.async_save import checkpoint_group
from fsdp_optim.job.memory_save import MemoryTier
from fsdp_optim.job.node_memory import MemoryTierDamaged, NodeMemory
from fsdp_optim.job.root import Root, verify_root
from fsdp_optim.job.sampler import resume_data
from fsdp_optim.job.transport import ProcessGroup, all_gather_objects, is_cpu_group
from fsdp_optim.job.whole_load import LOAD_WINDOW_BYTES, LoadPlans, Staged, commit_load, plan_load, stage_load

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
    durable: int | None  # the newest durable step, as rank 0 found it


def find_in_memory(
    tier: MemoryTier, group: ProcessGroup, durable: Callable[[], int | None] | None = None
) -> tuple[list[str], list[list[Holding]], Chosen | None, int | None]:
    """Step 1: every rank's node and holdings, the step to restore (the same on every rank), and what ``durable()``
    returned on the rank that passed it (rank 0: the newest durable step). One all-gather."""
    found: tuple[int | None, str | None] = (None, None)
    if durable is not None:
        try:
            found = (durable(), None)
        except Exception as exc:  # every rank raises it, below, rather than waiting for this one
            found = (None, f"{type(exc).__name__}: {exc}")
    reports = all_gather_objects((tier.node, read_holdings(tier.node_dir()), found), group)
    failed = next((f"{error} [raised on rank {r}]" for r, (_, _, (_, error)) in enumerate(reports) if error), None)
    if failed is not None:
        raise RuntimeError(f"looking for the newest durable step failed: {failed}")
    holdings = [list(h) for _, h, _ in reports]
    newest = next((step for _, _, (step, _) in reports if step is not None), None)
    return [n for n, _, _ in reports], holdings, choose_step(holdings), newest


def restore_from_memory(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    tier: MemoryTier,
    *,
    durable: Callable[[], int | None] | None = None,
    buffers: str = "refuse",
    data: object = None,
) -> MemoryRestore:
    """Load the newest step the live nodes' memory tiers hold whole into ``model`` and ``optim``, unless none does
    or it is older than the newest durable step (``durable()``, run on rank 0 alone; its answer travels with the
    holdings and comes back as ``durable``): then nothing is changed and ``loaded`` is False. A collective: every
    rank gets the same answer, or raises the same error (:class:`.node_memory.MemoryTierDamaged` when the step's
    bytes could not be read). ``buffers`` and ``data``: as in :func:`fsdp_optim.load_checkpoint`."""
    root = verify_root(model, optim)
    group = root.group if is_cpu_group(root.group) else checkpoint_group(root.group)
    nodes, holdings, chosen, newest = find_in_memory(tier, group, durable if root.rank == 0 else None)
    live = len(set(nodes))
    if chosen is None or (newest is not None and chosen.step < newest):
        return MemoryRestore(chosen.step if chosen is not None else None, live, None, None, False, newest)
    directory = tier.node_dir() / chosen.dirname
    what = f"restoring step {chosen.step} from the memory tiers changed nothing on any rank"
    # Every rank's transfers, which its prefetch sends and receives: planned from the checkpoint opened through this
    # location, so given to it as the list that the planning fills.
    fetches: list[Fetch] = []
    node = NodeMemory(directory, group, fetches=lambda: fetches)
    if not all(_holds_step(report, chosen) for report in holdings):
        src = min(r for r, report in enumerate(holdings) if _holds_step(report, chosen))
        node.spread_manifest(src, nodes, what=what)
    ckpt = None
    try:
        with step(what, group=group):  # nothing is changed anywhere when any rank fails
            ckpt, plans, planned = _plan(root, model, optim, node, chosen, nodes, holdings, buffers)
            fetches.extend(planned)
        staged = _fetch_and_stage(root, ckpt, plans, group, what)
    finally:
        if ckpt is not None:
            ckpt.close()
    with step("check the data position", group=group):
        then = resume_data(data, staged.data, f"step {chosen.step} in the memory tier")
    commit_load(root, model, optim, staged)
    then()
    return MemoryRestore(chosen.step, live, directory, staged.extra, True, newest)


def _plan(
    root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, node: NodeMemory, chosen: Chosen,
    nodes: list[str], holdings: list[list[Holding]], buffers: str,
) -> tuple[ShardedCheckpoint, LoadPlans, list[Fetch]]:  # fmt: skip
    """Step 3: the step opened through this node's memory (its manifest read), the load planned once, and every
    rank's fetches (what the location's prefetch sends and receives)."""
    try:
        ckpt = open_checkpoint(node, max_mapped_bytes=LOAD_WINDOW_BYTES)
    except (OSError, ValueError) as exc:
        raise MemoryTierDamaged(str(exc)) from exc
    try:
        plans = plan_load(root, model, optim, ckpt, buffers)
        spans = [load_spans(ckpt, plans.weights, plans.optim, r, buffers=plans.buffers) for r in range(root.world_size)]
        needs = [[s[:3] for s in ranges] for ranges in spans]  # (file, start, stop)
        has = {nodes[r]: _held(h, chosen) for r, h in enumerate(holdings)}
        return ckpt, plans, list(fetch_plan(chosen, nodes, needs, has))
    except BaseException:
        ckpt.close()
        raise


def _fetch_and_stage(root: Root, ckpt: ShardedCheckpoint, plans: LoadPlans, group: ProcessGroup, what: str) -> Staged:
    """Step 4: every transfer posted (the prefetch of the step's location), the load read from this node's files and
    the pieces received as they arrive, every transfer waited for; agreed."""
    spans = lambda: load_spans(ckpt, plans.weights, plans.optim, root.rank, buffers=plans.buffers)  # noqa: E731
    with step(what, group=group), _damaged():
        with ckpt.fetched_ahead(spans) as sides:  # (NodeMemory needs no spans: its plan covers every rank's)
            staged = stage_load(root, ckpt, plans, sides)
    return staged


@contextmanager
def _damaged() -> Iterator[None]:
    """Any failure to read a step from the memory tiers is :class:`MemoryTierDamaged` (durable storage is next)."""
    try:
        yield
    except MemoryTierDamaged:
        raise
    except Exception as exc:
        raise MemoryTierDamaged(str(exc)) from exc


def _held(report: list[Holding], chosen: Chosen) -> frozenset[str]:
    return next((h.held for h in report if (h.step, h.save_id) == (chosen.step, chosen.save_id)), frozenset())


def _holds_step(report: list[Holding], chosen: Chosen) -> bool:
    return any((h.step, h.save_id) == (chosen.step, chosen.save_id) for h in report)
