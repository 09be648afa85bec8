"""``ResumableSampler``: ``DistributedSampler``'s order, with a position that resumes at any world size.

    sampler = fsdp_optim.ResumableSampler(dataset, shuffle=True, seed=0, global_batch_size=12)
    loader = DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler)   # 12 / world size per rank
    manager.restore(model, optim, data=sampler)          # the position too; a fresh run leaves it at the start
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)                          # keeps a restored position in that epoch
        for batch in loader:                              # starts at this rank's share of the next global batch
            train_step(batch)
            sampler.advance()                             # one global batch consumed
            manager.save(step, model, optim, data=sampler)

The position (:class:`~fsdp_optim.core.data_position.DataPosition`) counts samples consumed globally, which the
loop reports with :meth:`advance` (the sampler cannot count them: a ``DataLoader`` with workers draws indices ahead
of the batches it hands out). Global batch t is the window ``order[t*B:(t+1)*B]`` of the epoch's padded order at any
world size (the window a ``DistributedSampler`` with per-rank batch B/W deals), so a run resumed at another world
size with the same global batch sees the same samples per global batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sized
from functools import partial
from typing import Any

from torch.utils.data import Dataset, DistributedSampler

from fsdp_optim.core.data_position import DataPosition, ResumeReport, epoch_order, padded_order, plan_resume
from fsdp_optim.job.transport import dist_rank_and_size, group_initialized

__all__ = ["ResumableSampler", "agreed_position", "data_position", "resume_data"]


class ResumableSampler(DistributedSampler[int]):
    """A drop-in for ``torch.utils.data.DistributedSampler`` (same arguments, same order, index for index, at the same
    world size) whose :meth:`state_dict` records where the job stands in its data stream, world-size free, and whose
    :meth:`load_state_dict` starts each rank at its share of the next global batch at any world size.

    ``num_replicas`` and ``rank`` default to the default process group's. ``global_batch_size``: the samples of one
    optimizer step over all ranks, a multiple of ``num_replicas`` (:attr:`batch_size` is each rank's, for the
    ``DataLoader``); needed by :meth:`advance`, :meth:`state_dict` and :meth:`load_state_dict`. A resume with another
    global batch is refused, naming both, unless ``allow_batch_change=True``: then the stream goes on from the same
    sample, rounded down to a multiple of the world size, and a warning says how many samples are repeated or
    skipped. ``resumed`` holds the last resume's :class:`~fsdp_optim.core.data_position.ResumeReport`.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        global_batch_size: int | None = None,
        allow_batch_change: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not group_initialized():
                raise RuntimeError("ResumableSampler: pass num_replicas and rank, or initialize a process group first")
            group_rank, group_size = dist_rank_and_size(None)
            num_replicas = group_size if num_replicas is None else num_replicas
            rank = group_rank if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        if global_batch_size is not None and (
            type(global_batch_size) is not int or global_batch_size < 1 or global_batch_size % num_replicas
        ):
            raise ValueError(f"global_batch_size: expected a positive multiple of num_replicas={num_replicas}, found "
                             f"{global_batch_size!r}")  # fmt: skip
        self.global_batch_size = global_batch_size
        self.allow_batch_change = allow_batch_change
        self.consumed = 0  # samples consumed globally in this epoch: where the next __iter__ starts
        self.resumed: ResumeReport | None = None

    @property
    def batch_size(self) -> int:
        """Each rank's batch: ``global_batch_size // num_replicas`` (the ``DataLoader``'s ``batch_size``)."""
        return self._global_batch("batch_size") // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from the current position to the epoch's end: ``DistributedSampler``'s own at the
        epoch's start."""
        order = padded_order(epoch_order(len(self._sized()), self.seed, self.epoch, self.shuffle), self.num_replicas,
                             self.drop_last)  # fmt: skip
        return iter(order[self.consumed + self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.consumed + self.rank, self.total_size, self.num_replicas))

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``; another epoch than the current one starts at its first sample, the
        current one (a restored position's) stays where it is."""
        if epoch != self.epoch:
            self.consumed = 0
        super().set_epoch(epoch)

    def advance(self, batches: int = 1) -> None:
        """Record that the loop consumed ``batches`` more global batches of this epoch (call after each step; the
        epoch's last, partial batch counts as one)."""
        if type(batches) is not int or batches < 0:
            raise ValueError(f"advance: batches must be an int >= 0, found {batches!r}")
        self.consumed = min(self.consumed + batches * self._global_batch("advance"), self.total_size)

    def position(self) -> DataPosition:
        """Where the job stands: :class:`~fsdp_optim.core.data_position.DataPosition`."""
        return DataPosition(
            seed=self.seed, epoch=self.epoch, consumed=self.consumed, global_batch=self._global_batch("state_dict"),
            dataset_length=len(self._sized()), shuffle=self.shuffle, drop_last=self.drop_last,
            world_size=self.num_replicas,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The position as a dict, the same on every rank::

        {"version": 1, "seed": 0, "epoch": 3, "consumed": 48, "global_batch": 12, "dataset_length": 60,
         "shuffle": True, "drop_last": False, "world_size": 2}
        """
        return self.position().to_dict()

    def plan_load(self, state: Mapping[str, Any] | DataPosition, *, where: str = "state_dict") -> ResumeReport:
        """What :meth:`load_state_dict` would do with ``state`` (checked, nothing changed): a ``ValueError`` where
        the stream cannot be kept (see the class docstring)."""
        saved = state if isinstance(state, DataPosition) else DataPosition.from_dict(state, where=where)
        if isinstance(state, DataPosition):
            saved.check(where)
        return plan_resume(saved, self.position(), allow_batch_change=self.allow_batch_change)

    def load_state_dict(self, state: Mapping[str, Any] | DataPosition) -> ResumeReport:
        """Go to the saved position: the next ``__iter__`` gives this rank its share of the next global batch of the
        saved epoch. A warning says how many samples of the rest of the epoch are repeated or skipped, when any are
        (another world size pads or cuts the epoch's tail differently; another global batch, if allowed)."""
        report = self.plan_load(state)
        self.epoch, self.consumed, self.resumed = report.epoch, report.start, report
        if report.repeated or report.skipped:
            warnings.warn(f"ResumableSampler: {report}", stacklevel=2)
        return report

    def _global_batch(self, what: str) -> int:
        if self.global_batch_size is None:
            raise ValueError(f"ResumableSampler.{what} needs the global batch: pass global_batch_size= (a multiple "
                             f"of num_replicas={self.num_replicas})")  # fmt: skip
        return self.global_batch_size

    def _sized(self) -> Sized:
        assert isinstance(self.dataset, Sized), "DistributedSampler needs a dataset with a length"
        return self.dataset


def data_position(data: object, *, where: str = "data") -> DataPosition | None:
    """The position that a save records for ``data``: a :class:`ResumableSampler`, its ``state_dict()`` or a
    :class:`~fsdp_optim.core.data_position.DataPosition`; None for None."""
    if data is None:
        return None
    if isinstance(data, ResumableSampler):
        return data.position()
    if isinstance(data, DataPosition):
        data.check(where)
        return data
    if isinstance(data, Mapping):
        return DataPosition.from_dict(data, where=where)
    raise TypeError(f"{where}: expected a ResumableSampler, its state_dict() or a DataPosition, found "
                    f"{type(data).__name__}")  # fmt: skip


def resume_data(data: object, saved: DataPosition | None, where: str) -> Callable[[], object]:
    """Check that ``data`` (what a load was given: a :class:`ResumableSampler`, or None) can go to the ``saved``
    position (nothing is changed here); the change to make once the load committed (nothing, for None)."""
    if data is None:
        return lambda: None
    if not isinstance(data, ResumableSampler):
        raise TypeError(f"data: expected a ResumableSampler to restore, found {type(data).__name__}")
    if saved is None:
        raise ValueError(f"data: {where} records no data position (it was saved without data=); load it without "
                         "data= and start the sampler afresh")  # fmt: skip
    data.plan_load(saved, where=where)
    return partial(data.load_state_dict, saved)


def agreed_position(positions: list[DataPosition | None]) -> DataPosition | None:
    """The one position every rank's save gave (all-gathered); a ``ValueError``, the same on every rank, when the
    ranks gave different ones (or some none)."""
    if len(set(positions)) > 1:
        shown = "; ".join(f"rank {r}: {p.to_dict() if p is not None else None}" for r, p in enumerate(positions[:4]))
        raise ValueError(f"data: every rank must save the same data position (the job's, not a rank's), found {shown}")
    return positions[0]
