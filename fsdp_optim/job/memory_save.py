"""Saving a whole checkpoint into the memory tier: each node's host memory (tmpfs), replicated on other nodes.

Training blocks as long as for :func:`fsdp_optim.async_save_checkpoint`: the checks, the copies of buffers and
``extra``, and one small all-gather (the save id and every rank's node). A background thread then copies the shards
into the reused staging buffers and, on the checkpoint group (:func:`~fsdp_optim.job.async_save.checkpoint_group`):

1. every rank writes its rank and side files into its node's step directory and rank 0 the manifest
   (:func:`fsdp_optim.job.save_commit.commit_save` into a :class:`~fsdp_optim.job.node_memory.NodeMemory`, the
   location every save writes through: all ranks or none);
2. the location's commit (:class:`~fsdp_optim.job.node_memory.MemoryWriter`, whose ``commit`` the save driver
   calls on every rank as on any location: the seal): the manifest is broadcast and written
   on every node; each rank sends its two files to its replica peers
   (:func:`fsdp_optim.core.memory_plan.replica_peers`, on other nodes), which write them beside their own;
3. once every rank says all its parts and replicas are in (one all-gather), the first rank of each node writes its
   marker (the step becomes visible there) and prunes the node to the newest ``keep`` complete steps.

A rank killed at any point before 3 leaves no marker of that step anywhere: the previous step stays the newest.
Layout on disk: :mod:`fsdp_optim.formats.sharded.memory_tier`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.location import Location
from fsdp_optim.formats.sharded.memory_tier import default_memory_dir, node_dir, node_name, step_dirname
from fsdp_optim.job.async_save import AsyncSave, checkpoint_group, finish_previous, launch
from fsdp_optim.job.node_memory import NodeMemory, Sealing
from fsdp_optim.job.root import verify_root
from fsdp_optim.job.save_commit import commit_save
from fsdp_optim.job.transport import all_gather_objects, dist_rank_and_size
from fsdp_optim.job.whole_save import prepare_whole

__all__ = ["MemoryTier", "memory_tier", "save_to_memory"]

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
    """This rank's :class:`MemoryTier`. ``node``: given, else ``$FSDP_OPTIM_NODE``, else torchrun's grouping
    ``rank // $LOCAL_WORLD_SIZE`` (every rank on node 0 without it). ``memory_dir``: given, else
    ``/dev/shm/fsdp_optim-<12 hex of the manager root's absolute path>``."""
    for name, value, low in (("replicas", replicas, 0), ("keep_memory", keep, 1)):
        if type(value) is not int or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, found {value!r}")
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
