"""``CheckpointManager``: whole-state checkpoints of a training loop, one directory per saved step, old ones pruned.

    manager = fsdp_optim.CheckpointManager("ckpt", every=1000, keep=3, keep_every=10_000)
    extra = manager.restore(model, optim)            # None on a fresh run
    start = extra["step"] if extra is not None else 0
    for step in range(start + 1, total + 1):
        train_one_step(...)
        manager.save(step, model, optim, extra={"step": step, ...})   # every rank, every step

Step directories, and what is ours to prune: :mod:`fsdp_optim.formats.sharded.steps`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.steps import check_schedule, step_dir_name, steps_to_keep
from fsdp_optim.disk.location import Location, public
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.memory_tier import node_name, tier_bytes
from fsdp_optim.formats.sharded.steps import (
    COMPLETE,
    PRUNING,
    StepDir,
    find_step_dirs,
    pruning_marks,
    remove_step,
    survey_root,
    survey_step,
    tidy_root,
)
from fsdp_optim.job import agreed
from fsdp_optim.job.agreed import interrupts_deferred
from fsdp_optim.job.async_save import AsyncSave
from fsdp_optim.job.memory import MemoryRestore, MemoryTier, memory_tier, restore_from_memory, save_to_memory
from fsdp_optim.job.node_memory import MemoryTierDamaged
from fsdp_optim.job.root import verify_root
from fsdp_optim.job.transport import agree, broadcast_object, dist_rank_and_size, group_initialized
from fsdp_optim.job.whole_load import load_checkpoint
from fsdp_optim.job.whole_save import async_save_checkpoint, save_checkpoint

__all__ = ["CheckpointManager", "SkippedStep"]

_log = logging.getLogger("fsdp_optim")


@dataclass(frozen=True)
class SkippedStep:
    """A step directory :meth:`CheckpointManager.latest` passed over: ``state`` ``"torn"`` (no manifest: a save
    that did not finish) or ``"damaged"`` (``reason`` names the file and what is wrong with it)."""

    step: int
    path: Path | Location
    state: str
    reason: str

    def __str__(self) -> str:
        return f"step {self.step} ({self.path}) is {self.state}: {self.reason}"


class CheckpointManager:
    """Save a training loop's whole state every ``every`` steps under ``root``, keep the newest ``keep`` complete
    steps (and every step divisible by ``keep_every``), and find the newest usable one to resume from.

    ``async_save=True`` saves with :func:`fsdp_optim.async_save_checkpoint` (the loop blocks only for the checks;
    the optimizer's next ``step()`` waits for the copy): the save is waited for, and pruned after, at the next
    :meth:`save` that saves, at :meth:`wait`, :meth:`latest` and :meth:`restore`. Call :meth:`wait` before the
    process exits. A model saved without an optimizer is saved synchronously.

    ``memory_every=N`` adds the memory tier (:mod:`fsdp_optim.job.memory`): every N steps the whole state also
    goes into each node's host memory (``memory_dir``, default ``/dev/shm/fsdp_optim-<hash of root>``; a tmpfs that
    outlives the process), with ``replicas`` copies of each rank's files on other nodes, blocking the loop as long
    as an async save does; each node keeps its newest ``keep_memory`` complete steps (``memory_bytes``: what this
    rank's node holds after the last one). :meth:`restore` then loads the newest step that the live nodes hold whole,
    at any world size, unless durable storage holds a newer one; ``restored_from`` says which (``"memory"``,
    ``"durable"`` or None) and ``restored_step`` the step. ``node`` names this rank's node (default
    ``$FSDP_OPTIM_NODE``, else ``rank // $LOCAL_WORLD_SIZE``, torchrun's grouping).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Location,
        *,
        every: int,
        keep: int,
        keep_every: int | None = None,
        async_save: bool = False,
        memory_every: int | None = None,
        replicas: int = 1,
        memory_dir: str | os.PathLike[str] | None = None,
        node: str | int | None = None,
        keep_memory: int = 2,
    ) -> None:
        check_schedule(every, keep, keep_every)
        memory = (("memory_every", memory_every, 1), ("keep_memory", keep_memory, 1), ("replicas", replicas, 0))
        for name, value, low in memory if memory_every is not None else ():
            if type(value) is not int or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, found {value!r}")
        self.memory_every, self.replicas, self.keep_memory = memory_every, replicas, keep_memory
        self.memory_dir, self.node = memory_dir, node_name(node) if node is not None else None
        self._memory: tuple[AsyncSave | Path, MemoryTier] | None = None  # a memory-tier save in flight
        self.memory_bytes: int | None = None  # what this rank's node's memory tier held after its last save
        self.restored_from: str | None = None  # what the last restore() loaded from: "memory", "durable", None
        self.restored_step: int | None = None
        self.async_save = async_save
        self._pending: tuple[int, AsyncSave, int] | None = None  # (step, its handle, this rank) of a save in flight
        self.root = where(root)  # a local directory, or a prefix of an object store
        self.every, self.keep, self.keep_every = every, keep, keep_every
        self.skipped: tuple[SkippedStep, ...] = ()  # what the last latest() passed over, newest first

    def __repr__(self) -> str:
        schedule = f"every={self.every}, keep={self.keep}, keep_every={self.keep_every}"
        return f"CheckpointManager({str(self.root)!r}, {schedule})"

    def path(self, step: int) -> Path | Location:
        """The directory of ``step``: ``root/step-00000042``."""
        return public(self.root.child(step_dir_name(step)))

    def save(
        self, step: int, model: nn.Module, optim: torch.optim.Optimizer | None, extra: Any = None, *, data: Any = None
    ) -> Path | Location | None:
        """Call on every rank after every step: when ``step % every == 0``, save the whole state into
        :meth:`path` (``save_checkpoint``: a collective; a step saved before is replaced atomically) and return
        that directory; else return None at once (no collective, no file access). When ``step % memory_every == 0``
        the step also goes into the memory tier (in the background when there is an optimizer; a collective).
        A torn save of that step (a run killed mid-save) is cleaned up first; a step directory holding foreign
        files, or a manifest that is not readable as ours, is refused on every rank
        (``ForeignOutputError``), never overwritten.

        After the save committed, rank 0 prunes (no collective): every step directory of ours older than ``step``
        that is not kept (the newest ``keep`` complete steps up to ``step``, every complete step divisible by
        ``keep_every``) is removed, torn and damaged ones included; a directory holding anything that fsdp_optim
        did not write is kept, with a warning naming it, and so is anything in ``root`` that is not a step
        directory. Steps newer than ``step`` (a run resumed from an older step) are left alone. A prune that
        fails warns rather than raises, so that every rank goes on to the same next step. ``data``: as in
        ``save_checkpoint``.
        """
        directory = self.path(step)
        memory = self.memory_every is not None and step % self.memory_every == 0
        if step % self.every != 0 and not memory:
            return None
        self.wait()
        if memory:
            tier = self._tier()
            self._memory = (save_to_memory(model, optim, tier, step, extra=extra, data=data), tier)
        if step % self.every != 0:
            return None
        rank, _ = dist_rank_and_size(verify_root(model).group)
        if self.async_save and optim is not None:
            self._pending = (step, async_save_checkpoint(model, optim, directory, extra=extra, data=data), rank)
            return directory
        save_checkpoint(model, optim, directory, extra=extra, data=data)
        self._pruned(step, rank)
        return directory

    def wait(self) -> Path | Location | None:
        """Wait for the async save in flight, if any (raising its error on every rank), then prune after it; the
        directory it committed, or None. A collective when a save is in flight. A memory-tier save in flight is
        waited for first (its error raised on every rank)."""
        if self._memory is not None:
            handle, tier = self._memory
            self._memory = None
            if isinstance(handle, AsyncSave):
                handle.wait()
            self.memory_bytes = tier_bytes(tier.node_dir())
        if self._pending is None:
            return None
        step, handle, rank = self._pending
        self._pending = None
        handle.wait()
        self._pruned(step, rank)
        return self.path(step)

    def _pruned(self, step: int, rank: int) -> None:
        if rank == 0:
            try:
                self._prune(step)
            except OSError as exc:
                _warn(f"CheckpointManager: pruning {self.root} after step {step} failed: {exc}")

    def _prune(self, saved: int) -> None:
        """Remove the steps not kept (and finish the removals a killed prune began), a first Ctrl-C held until the
        end (each removal is crash-safe: :func:`~fsdp_optim.formats.sharded.steps.remove_step`)."""
        with interrupts_deferred(f"the prune of {self.root} after step {saved}"):
            tidy_root(self.root, saved=saved)
            found = [d for d in survey_root(self.root, verify=False) if d.step < saved or d.state == PRUNING]
            complete = [d.step for d in found if d.state == COMPLETE] + [saved]
            kept = steps_to_keep(complete, keep=self.keep, keep_every=self.keep_every)
            for step_dir in (d for d in found if d.step not in kept or d.state == PRUNING):
                if not step_dir.ours:
                    _warn(f"CheckpointManager kept {step_dir.path}: {_why_not_ours(step_dir)}")
                elif not remove_step(self.root, step_dir):
                    _warn(
                        f"CheckpointManager kept {step_dir.path}: another writer holds it, or it now holds files "
                        "that fsdp_optim did not write"
                    )

    def latest(self) -> int | None:
        """The newest step whose checkpoint is complete and verified (every file present, of its size, every
        checksum matching), or None. Newer step directories that are torn or damaged are skipped: they are listed
        in its ``skipped`` attribute (:class:`SkippedStep` records) and warned about.

        Same answer on every rank: inside a job (a default process group is initialized) rank 0 verifies and
        broadcasts its finding (two small collectives over the default group: every process calls it; an error on
        rank 0 is raised on every rank); without one the calling process verifies by itself. Cost: every byte of
        each candidate read once, newest first, until one verifies.
        """
        self.wait()
        if group_initialized():
            rank, _ = dist_rank_and_size(None)
            with agreed.step(f"CheckpointManager.latest() could not read {self.root}", group=None):
                found = _find_latest(self.root) if rank == 0 else None  # (an error: every rank raises it)
            step, skipped = broadcast_object(found, src=0, group=None)
            warn = rank == 0
        else:
            (step, skipped), warn = _find_latest(self.root), True
        self.skipped = tuple(skipped)
        for record in self.skipped if warn else ():
            _warn(f"CheckpointManager.latest() skipped {record}")
        return step

    def restore(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer | None,
        step: int | None = None,
        *,
        buffers: str = "refuse",
        data: Any = None,
    ) -> Any:
        """Load ``step`` (default: :meth:`latest`) into ``model`` and ``optim`` with :func:`fsdp_optim.load_checkpoint`
        and return its ``extra``; None when there is nothing to restore (no usable step: a fresh run). A collective:
        call on every rank.

        With the memory tier (``memory_every``) and no ``step`` given, the newest step the live nodes' memory tiers
        hold whole is restored (:func:`fsdp_optim.job.memory.restore_from_memory`), unless durable storage
        holds a newer complete step; when no step survives whole in memory, or its bytes fail a check on some rank
        (:class:`~fsdp_optim.job.node_memory.MemoryTierDamaged`, raised on every rank with nothing changed), a
        warning says so and the newest durable step is restored. ``restored_from`` and ``restored_step`` say what
        was loaded. ``buffers`` and ``data``: as in :func:`fsdp_optim.load_checkpoint` (``data`` is untouched on a
        fresh run)."""
        self.wait()
        self.restored_from, self.restored_step = None, None
        damaged = None
        if step is None and self.memory_every is not None:
            try:
                found = restore_from_memory(
                    model, optim, self._tier(), durable=self._newest_durable, buffers=buffers, data=data
                )
            except MemoryTierDamaged as exc:  # raised on every rank, nothing changed: durable storage is next
                damaged, found = exc, MemoryRestore(None, 0, None, None, loaded=False, durable=None)
            if found.loaded:
                self.restored_from, self.restored_step = "memory", found.step
                _log.info("CheckpointManager restored step %s from the memory tiers of %s nodes", found.step,
                          found.nodes)  # fmt: skip
                return found.extra
            if found.durable is not None:  # (nothing anywhere: a fresh run, nothing to say)
                self._say_fallback(model, found.step, found.nodes, found.durable)
        if step is None:
            step = self.latest()
            if step is None:
                if damaged is not None:
                    raise damaged
                return None
            if damaged is not None and dist_rank_and_size(verify_root(model).group)[0] == 0:
                _warn(f"CheckpointManager.restore: the memory tiers' newest step could not be restored "
                      f"({damaged}); restoring durable step {step} from {self.root}")  # fmt: skip
        extra = load_checkpoint(model, optim, self.path(step), buffers=buffers, data=data)
        self.restored_from, self.restored_step = "durable", step
        return extra

    def clear_memory(self) -> list[Path]:
        """Remove this node's memory tier (its steps in ``/dev/shm``, or ``memory_dir``) when the job is done with it,
        and the memory directory once no node's tier is left there; durable checkpoints are not touched. Call on every
        rank after the last save (a collective: two small agreements); a save in flight is waited for first. Returns the
        directories this rank removed."""
        self.wait()
        if self.memory_every is None:
            return []
        tier = self._tier()
        removed = []
        agree(None, group=None, what="CheckpointManager.clear_memory")  # every rank's last memory save is sealed
        if tier.node_dir().is_dir():
            shutil.rmtree(tier.node_dir(), ignore_errors=True)  # the node's other ranks may be removing it too
            removed.append(tier.node_dir())
        agree(None, group=None, what="CheckpointManager.clear_memory")  # every node's tier is gone
        with contextlib.suppress(OSError):  # not empty: another job's tier in a shared memory_dir is kept
            tier.directory.rmdir()
            removed.append(tier.directory)
        return removed

    def _tier(self) -> MemoryTier:
        rank, _ = dist_rank_and_size(None)
        return memory_tier(self.root, memory_dir=self.memory_dir, node=self.node, replicas=self.replicas,
                           keep=self.keep_memory, rank=rank)  # fmt: skip

    def _newest_durable(self) -> int | None:
        """The newest durable step with a manifest and every file of its size (not verified byte by byte)."""
        return max((d.step for d in survey_root(self.root, verify=False) if d.state == COMPLETE), default=None)

    def _say_fallback(self, model: nn.Module, memory: int | None, nodes: int, durable: int | None) -> None:
        if dist_rank_and_size(verify_root(model).group)[0] != 0:
            return
        held = (
            f"no step survives whole in the memory tiers of the {nodes} live nodes"
            if memory is None
            else (f"the memory tiers hold step {memory}, older than durable step {durable}")
        )
        _warn(f"CheckpointManager.restore: {held}; restoring from durable storage {self.root}")


def _find_latest(root: Location) -> tuple[int | None, list[SkippedStep]]:
    skipped: list[SkippedStep] = []
    marked = pruning_marks(root)
    for step, path in reversed(find_step_dirs(root)):
        step_dir = survey_step(step, path, verify=True, pruning=step in marked)
        if step_dir.state == COMPLETE:
            return step, skipped
        skipped.append(SkippedStep(step, path, step_dir.state, step_dir.reason))
    return None, skipped


def _why_not_ours(step_dir: StepDir) -> str:
    if step_dir.foreign:
        shown = ", ".join(step_dir.foreign[:3]) + (", ..." if len(step_dir.foreign) > 3 else "")
        return f"it holds what fsdp_optim did not write ({shown}); remove those to let it be pruned"
    return f"it is not a checkpoint fsdp_optim can read ({step_dir.reason}); it is left for you to inspect"


def _warn(message: str) -> None:
    """A ``UserWarning`` at the first frame outside this package (the manager's methods call each other: no fixed
    ``stacklevel`` is right)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 2  # stacklevel 2: _warn's caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)
