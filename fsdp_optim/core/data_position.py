"""Where a training job stands in its data stream, in terms that do not depend on the world size; pure.

An epoch's order is one seeded permutation of the dataset, padded or cut to a multiple of the world size exactly as
``torch.utils.data.DistributedSampler`` does (:func:`padded_order`), and rank r of W takes positions r, r+W, ... of
it. With a per-rank batch b = B/W, local batch j of every rank together is the window ``order[j*B:(j+1)*B]`` of that
order: global batch j holds the same samples at any world size that keeps the global batch B. So a position is
(seed, epoch, samples consumed globally in the epoch, B, the dataset's length, shuffle, drop_last), saved once for the
whole job as a :class:`DataPosition`::

    {"version": 1, "seed": 0, "epoch": 3, "consumed": 48, "global_batch": 12, "dataset_length": 60,
     "shuffle": true, "drop_last": false, "world_size": 2}

``world_size`` is who saved it: it is not needed to resume, only to say what differs at the epoch's tail, where the
padding (drop_last=False) or the cut (drop_last=True) depends on the world size. :func:`plan_resume` checks a saved
position against a live sampler's and returns a :class:`ResumeReport`: where each rank starts, and how many of the
epoch's remaining samples the resumed run sees more often (repeated) or less often (skipped) than the saved run would.

Per-sample randomness (:func:`sample_generator`, :func:`sample_seed`) must not depend on which rank sees the sample,
or on how many ranks there are. A per-rank generator (``torch.manual_seed(seed + rank)``) draws a sample's
augmentation from whatever that rank drew before: after a resume at another world size the same sample lands on
another rank, after other draws, and gets other random numbers. Drawing from the seed and the sample's global index
instead gives the same numbers wherever and whenever the sample is seen::

    def __getitem__(self, index):
        g = fsdp_optim.sample_generator(self.seed, index, epoch=self.epoch)
        crop = torch.randint(0, 8, (2,), generator=g)          # the same on any rank, at any world size

What cannot carry over this way: randomness drawn per rank inside the model (dropout, stochastic depth) from the
global or CUDA generator. Its stream depends on the rank and the world size, so a resumed run at another world size
draws other masks; train without dropout where the trajectory must match, or accept a run that matches only in
distribution (reseed per rank from ``extra``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from fsdp_optim.core.records import get_checked

__all__ = [
    "DATA_POSITION_VERSION",
    "DataPosition",
    "ResumeReport",
    "epoch_order",
    "padded_order",
    "plan_resume",
    "sample_generator",
    "sample_seed",
    "total_size",
]

DATA_POSITION_VERSION = 1


@dataclass(frozen=True)
class DataPosition:
    """A job's place in its data stream (the module docstring shows its dict)."""

    seed: int
    epoch: int
    consumed: int  # samples consumed globally in ``epoch``: positions 0..consumed-1 of its padded order
    global_batch: int
    dataset_length: int
    shuffle: bool
    drop_last: bool
    world_size: int  # the saving job's: only to report the epoch's tail
    version: int = DATA_POSITION_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, **{k: v for k, v in asdict(self).items() if k != "version"}}

    @classmethod
    def from_dict(cls, d: Any, *, where: str) -> DataPosition:
        """The record of ``d`` (:meth:`to_dict`'s shape); a ``ValueError`` naming ``where`` for anything else."""
        version = get_checked(d, "version", int, where)
        if version != DATA_POSITION_VERSION:
            raise ValueError(f"{where}: data position version {version!r}, but this fsdp_optim reads "
                             f"{DATA_POSITION_VERSION}")  # fmt: skip
        values = {f.name: get_checked(d, f.name, bool if f.type == "bool" else int, where) for f in fields(cls)}
        position = cls(**values)
        position.check(where)
        return position

    def check(self, where: str) -> None:
        """Raise ``ValueError`` unless the numbers fit together (the types are the caller's: :meth:`from_dict`)."""
        if self.dataset_length < 1 or self.world_size < 1 or self.global_batch < 1 or self.epoch < 0:
            raise ValueError(f"{where}: expected dataset_length, world_size and global_batch >= 1 and epoch >= 0, "
                             f"found {self.to_dict()}")  # fmt: skip
        end = total_size(self.dataset_length, self.world_size, self.drop_last)
        if not 0 <= self.consumed <= end:
            raise ValueError(f"{where}: consumed {self.consumed} is outside the epoch's 0..{end} positions "
                             f"({self.dataset_length} samples at {self.world_size} ranks)")  # fmt: skip


@dataclass(frozen=True)
class ResumeReport:
    """What a resume does: rank r starts at position ``start + r`` of the epoch's padded order at ``world_size``;
    ``repeated`` and ``skipped`` count the samples of the rest of the epoch that this run sees more and less often
    than the saved run would have (0 and 0: exactly its stream)."""

    saved_world_size: int
    world_size: int
    saved_global_batch: int
    global_batch: int
    epoch: int
    start: int
    repeated: int
    skipped: int

    def __str__(self) -> str:
        sizes = (f"global batch {self.saved_global_batch} at {self.saved_world_size} ranks -> "
                 f"{self.global_batch} at {self.world_size}")  # fmt: skip
        return (f"data stream resumed in epoch {self.epoch} at sample {self.start} ({sizes}): "
                f"{self.repeated} samples repeated, {self.skipped} skipped before the epoch ends")  # fmt: skip


def total_size(length: int, world_size: int, drop_last: bool) -> int:
    """The epoch's padded length, as ``DistributedSampler`` computes it (its ``total_size``)."""
    if drop_last and length % world_size != 0:
        return math.ceil((length - world_size) / world_size) * world_size
    return math.ceil(length / world_size) * world_size


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of dataset indices: ``DistributedSampler``'s (``randperm`` seeded with ``seed + epoch``)."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


def padded_order(order: list[int], world_size: int, drop_last: bool) -> list[int]:
    """``order`` cut (``drop_last``) or padded by repeating it from its start, to :func:`total_size`."""
    size = total_size(len(order), world_size, drop_last)
    if size <= len(order):
        return order[:size]
    repeats = math.ceil(size / len(order))
    return (order * repeats)[:size]


def plan_resume(saved: DataPosition, live: DataPosition, *, allow_batch_change: bool = False) -> ResumeReport:
    """Check the ``saved`` position against the ``live`` sampler's (its consumed count is ignored) and say where the
    live ranks start. Refused (``ValueError`` listing every difference): another dataset length, seed, shuffle or
    drop_last, and, unless ``allow_batch_change``, another global batch. A finished epoch resumes at its end (nothing
    left; the loop's next ``set_epoch`` starts the next). With another global batch the start is rounded down to a
    multiple of the live world size, so that every rank gets as many samples (those few are seen again)."""
    errors = [
        f"{name} is {getattr(saved, name)!r} in the checkpoint but {getattr(live, name)!r} in this sampler"
        for name in ("dataset_length", "seed", "shuffle", "drop_last")
        if getattr(saved, name) != getattr(live, name)
    ]
    changed = saved.global_batch != live.global_batch
    if changed and not allow_batch_change:
        errors.append(
            f"the global batch was {saved.global_batch} samples ({saved.world_size} ranks x "
            f"{saved.global_batch / saved.world_size:g}) and is {live.global_batch} now ({live.world_size} ranks x "
            f"{live.global_batch // live.world_size}): the data stream continues exactly only with a global batch of "
            f"{saved.global_batch} (a per-rank batch of {saved.global_batch}/{live.world_size}); pass "
            "allow_batch_change=True to go on from the same sample with the new batch"
        )
    if errors:
        raise ValueError("cannot resume the data stream: " + "; ".join(errors))
    saved_end = total_size(saved.dataset_length, saved.world_size, saved.drop_last)
    end = total_size(live.dataset_length, live.world_size, live.drop_last)
    start = end if saved.consumed >= saved_end else min(saved.consumed, end)
    start -= start % live.world_size  # already a multiple when the global batch is kept (or at the end)
    before, after = _differing(saved, saved.consumed, saved_end, start, end)
    return ResumeReport(
        saved_world_size=saved.world_size, world_size=live.world_size, saved_global_batch=saved.global_batch,
        global_batch=live.global_batch, epoch=saved.epoch, start=start, repeated=(after - before).total(),
        skipped=(before - after).total(),
    )  # fmt: skip


def _differing(
    saved: DataPosition, consumed: int, saved_end: int, start: int, end: int
) -> tuple[Counter[int], Counter[int]]:
    """The samples of the saved run's rest of the epoch (positions ``consumed..saved_end``) and of the resumed run's
    (``start..end``), less the positions both see: below the dataset's length the padded orders of every world size
    agree (position p holds ``order[p % length]``), so only the few positions at the ends are read."""
    length = saved.dataset_length
    low, high = max(consumed, start), min(length, saved_end, end)  # positions both runs see, with the same sample
    order = epoch_order(length, saved.seed, saved.epoch, saved.shuffle)

    def outside(first: int, stop: int) -> Counter[int]:
        if low >= high:
            return Counter(order[p % length] for p in range(first, stop))
        positions = [*range(first, min(stop, low)), *range(max(first, high), stop)]
        return Counter(order[p % length] for p in positions)

    return outside(consumed, saved_end), outside(start, end)


_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: every input bit moves every output bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def sample_seed(seed: int, index: int, *, epoch: int = 0) -> int:
    """A seed in [0, 2**63) for sample ``index`` (its global index in the dataset) of ``epoch`` in a job seeded with
    ``seed``: a function of those three numbers alone, so the same on whichever rank sees the sample."""
    for name, value in (("seed", seed), ("index", index), ("epoch", epoch)):
        if type(value) is not int or value < 0:
            raise ValueError(f"sample_seed: {name} must be an int >= 0, found {value!r}")
    mixed = _mix((seed & _MASK) ^ 0x9E3779B97F4A7C15)
    mixed = _mix((mixed + epoch) & _MASK)
    return _mix((mixed + index) & _MASK) >> 1


def sample_generator(seed: int, index: int, *, epoch: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with :func:`sample_seed` (``seed``, ``index``, ``epoch``): draw
    sample ``index``'s augmentation or masking from it to get the same numbers on any rank and at any world size."""
    generator = torch.Generator(device=device)
    generator.manual_seed(sample_seed(seed, index, epoch=epoch))
    return generator
