"""The memory tier inside a job: a whole checkpoint saved into each node's host memory (tmpfs), replicated on other
nodes, and restored from the surviving nodes' at any world size and nesting. Layout on disk:
:mod:`fsdp_optim.formats.sharded.memory_tier`; the step as a location: :class:`~fsdp_optim.job.node_memory.NodeMemory`.

A save (:func:`save_to_memory`) blocks training as long as :func:`fsdp_optim.async_save_checkpoint`: the checks, the
copies of buffers and ``extra``, and one small all-gather (the save id and every rank's node). A background thread
then copies the shards into the reused staging buffers and, on the checkpoint group:

1. every rank writes its rank and side files into its node's step directory and rank 0 the manifest
   (:func:`fsdp_optim.job.save_commit.commit_save` into a ``NodeMemory``: all ranks or none);
2. the location's commit, the seal (:meth:`~fsdp_optim.job.node_memory.NodeMemory.seal`): the manifest is broadcast
   and written on every node; each rank sends its two files to its replica peers
   (:func:`fsdp_optim.core.memory_plan.replica_peers`, on other nodes), which write them beside their own;
3. once every rank says all its parts and replicas are in (one all-gather), the first rank of each node writes its
   marker (the step becomes visible there) and prunes the node to the newest ``keep`` complete steps.

A rank killed at any point before 3 leaves no marker of that step anywhere: the previous step stays the newest.

A restore (:func:`restore_from_memory`):

1. Every rank reads what its node holds (complete steps: marker, manifest, files of their recorded sizes) and the
   reports are all-gathered; every rank then picks the same step, the newest whose every file is held by the node of
   some live rank (:func:`fsdp_optim.core.memory_plan.choose_step`), or None.
2. A node lacking the step gets its manifest (one broadcast, only when some node lacks it).
3. Each rank opens the step in its node's directory and plans its load once (the plans of
   :func:`fsdp_optim.load_checkpoint`); from the same plans it finds the byte ranges every rank's load reads
   (:func:`~fsdp_optim.formats.sharded.byte_ranges.files_read`) and who sends which of those its node lacks
   (:func:`~fsdp_optim.core.memory_plan.fetch_plan`): no message needed. The ranks agree that planning went well.
4. Every receive and send is posted at once (the location's prefetch); each rank then loads, reading its node's files
   in place and the bytes it receives as they arrive, every chunk verified before use; nothing received is written
   anywhere. The ranks agree, then every rank changes its model and optimizer, or none does.

A failure to read the step's bytes raises :class:`~fsdp_optim.job.node_memory.MemoryTierDamaged` on every rank, with
nothing changed: the manager then restores from durable storage. Cost: one all-gather, two agreements, one message
per byte range received (each byte crosses the network once, plus at most a chunk on each side of each range), then
the load's own work.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.memory_plan import Chosen, Fetch, Holding, choose_step, fetch_plan
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.location import Location
from fsdp_optim.formats.sharded.byte_ranges import files_read, load_spans
from fsdp_optim.formats.sharded.memory_tier import (
    default_memory_dir,
    node_dir,
    node_name,
    read_holdings,
    step_dirname,
)
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint, open_checkpoint
from fsdp_optim.job.agreed import step
from fsdp_optim.job.async_save import AsyncSave, checkpoint_group, finish_previous, launch
from fsdp_optim.job.node_memory import MemoryTierDamaged, NodeMemory, Sealing
from fsdp_optim.job.root import Root, verify_root
from fsdp_optim.job.sampler import resume_data
from fsdp_optim.job.save_commit import commit_save
from fsdp_optim.job.transport import ProcessGroup, all_gather_objects, dist_rank_and_size, is_cpu_group
from fsdp_optim.job.whole_load import LOAD_WINDOW_BYTES, LoadPlans, Staged, commit_load, plan_load, stage_load
from fsdp_optim.job.whole_save import prepare_whole

__all__ = ["MemoryRestore", "MemoryTier", "find_in_memory", "memory_tier", "restore_from_memory", "save_to_memory"]

NODE_ENV = "FSDP_OPTIM_NODE"


@dataclass(frozen=True)
class MemoryTier:
    """Where this rank's node keeps its memory tier, and how it replicates: resolved once per manager."""

    directory: Path  # the memory directory, holding node-<node>/ for every node that uses it
    node: str  # this rank's node
    replicas: int  # copies of each rank's files on other nodes
    keep: int  # complete steps kept per node

    def node_dir(self) -> Path:
        return node_dir(self.directory, self.node)


def memory_tier(
    root: Path | Location,
    *,
    memory_dir: str | os.PathLike[str] | None,
    node: object,
    replicas: int,
    keep: int,
    rank: int,
) -> MemoryTier:
    """This rank's :class:`MemoryTier` (``replicas`` and ``keep`` checked by the manager). ``node``: given, else
    ``$FSDP_OPTIM_NODE``, else torchrun's grouping ``rank // $LOCAL_WORLD_SIZE`` (every rank on node 0 without it).
    ``memory_dir``: given, else ``/dev/shm/fsdp_optim-<12 hex of the manager root's absolute path>``."""
    if node is None:
        node = os.environ.get(NODE_ENV) or rank // int(os.environ.get("LOCAL_WORLD_SIZE") or (rank + 1))
    if memory_dir is None:
        memory_dir = default_memory_dir(root)
    return MemoryTier(Path(memory_dir), node_name(node), replicas, keep)


def save_to_memory(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    tier: MemoryTier,
    step: int,
    *,
    extra: Any = None,
    data: object = None,
) -> AsyncSave | Path:
    """Save the whole state of ``step`` into the memory tier (a collective: call on every rank). With an optimizer
    it runs in the background like :func:`fsdp_optim.async_save_checkpoint` (returns its handle; ``wait()`` gives
    this node's step directory or raises the save's error on every rank); without one, synchronously."""
    finish_previous(model)
    root = verify_root(model, optim)
    group = checkpoint_group(root.group)
    # an async save's blocking part agrees over the save's gloo group and reads no GPU scalar (as async_save does)
    caller_of = group if optim is not None else None
    prepared = prepare_whole(root, model, optim, extra, data=data, caller_of=caller_of)
    rank, _ = dist_rank_and_size(group)
    reports = all_gather_objects((new_save_id() if rank == 0 else None, tier.node), group)
    save_id, nodes = reports[0][0], [n for _, n in reports]
    assert save_id is not None, "rank 0 sends the save id"
    _warn_one_node(tier, nodes, rank)
    directory = tier.node_dir() / step_dirname(step, save_id)
    sealing = Sealing(step, save_id, nodes, tier.node, tier.replicas, tier.keep)
    node = NodeMemory(directory, group, sealing=sealing)  # this node's own: nothing to lock or replace
    optimizer = type(optim).__name__ if optim is not None else None

    def run(state: Any) -> Path:  # the module docstring's steps 1-3: commit_save's commit is the writer's seal
        commit_save(root.layout, prepared.local, state, optimizer, node, save_id, group, side=prepared)
        return directory

    if optim is None:
        return run(prepared.state)
    upload = lambda staged: run(prepared.after(staged, group))  # noqa: E731 - the thread's whole job
    return launch(model, directory, optim, prepared.state, upload, name=f"memory-{save_id[:8]}")


_warned: set[Path] = set()


def _warn_one_node(tier: MemoryTier, nodes: list[str], rank: int) -> None:
    """``replicas >= 1`` with every rank on one node: the "replica" sits on the node it should outlive (said once)."""
    if tier.replicas < 1 or len(set(nodes)) > 1 or rank != 0 or tier.directory in _warned:
        return
    _warned.add(tier.directory)
    warnings.warn(
        f"memory tier: replicas={tier.replicas}, but every rank is on node {nodes[0]!r}, so each replica is kept "
        "on the same node as the data it should survive; losing the node loses both. On several machines, set "
        f"${NODE_ENV} or torchrun's LOCAL_WORLD_SIZE so ranks are told apart by node (or pass node=)",
        stacklevel=3,
    )


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
    or it is older than the newest durable step (``durable()``, run on rank 0 alone): then nothing is changed and
    ``loaded`` is False. A collective: every rank gets the same answer, or raises the same error. ``buffers`` and
    ``data``: as in :func:`fsdp_optim.load_checkpoint`."""
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
        needs = [files_read(ckpt, plans.weights, plans.optim, r, buffers=plans.buffers) for r in range(root.world_size)]
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
