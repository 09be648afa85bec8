"""A whole checkpoint's side files (buffers and ``extra``) seen as named tensors, for ``diff`` and ``verify --deep``.

A whole checkpoint keeps the model's persistent buffers and each rank's ``extra`` in side files
(:mod:`fsdp_optim.formats.sharded.side_file`), not in the rank files the optimizer state and weights come from;
this is the walk over them, one saved rank at a time (side files are small: buffers and loop state)::

    side = SideState.of(opened)           # None: not a whole checkpoint
    side.buffer_names                     ("block1.seen", "norm.running_mean", ...)  as the manifest lists them
    side.per_rank                         False: rank 0's side file holds the buffers; True: every rank its own
    side.rank(1)                          ({"block1.seen": T[4], ...}, {"['rng']": T[5056], "['opt'][0]": T[3]})

``rank(r)``'s buffers are rank 0's unless they were saved per rank; its second dict is ``extra``'s tensors keyed
by where they sit in the tree (``"['rng']"``; the root itself ``""``). Non-tensor values of ``extra`` are not
included.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import read_rank_side
from fsdp_optim.formats.sharded.training import TrainingRecord
from fsdp_optim.offline.sources import Opened

__all__ = ["BUFFER_KEY", "SideState", "extra_label"]

BUFFER_KEY = "@buffer"  # the key of a buffer's row or finding, beside the weights' "@param"


def extra_label(rank: int) -> str:
    """What a row or finding of saved rank ``rank``'s ``extra`` is named, in place of a parameter's name."""
    return f"extra of rank {rank}"


@dataclass(frozen=True)
class SideState:
    """The side files of one whole checkpoint (see the module docstring)."""

    checkpoint: ShardedCheckpoint
    training: TrainingRecord

    @classmethod
    def of(cls, opened: Opened) -> SideState | None:
        ckpt = opened.checkpoint
        if ckpt is None or ckpt.manifest.training is None:
            return None
        return cls(ckpt, ckpt.manifest.training)

    @property
    def world_size(self) -> int:
        return self.checkpoint.manifest.world_size

    @property
    def per_rank(self) -> bool:
        return self.training.buffers_per_rank

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.training.buffers)

    def rank(self, saved_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(buffers, extra's tensors by place)`` of saved rank ``saved_rank`` (both checked against the manifest)."""
        buffers, extra = read_rank_side(self.checkpoint.directory, self.training, saved_rank)
        return buffers, dict(_tensors(extra, ""))


def _tensors(value: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``extra``'s tree (its depth is bounded by the side file's reader), keyed by its place."""
    if torch.is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")
