"""A whole checkpoint's side files (buffers and ``extra``) seen as named tensors, for ``diff`` and ``verify --deep``.

A whole checkpoint keeps the model's persistent buffers and each rank's ``extra`` in side files
(:mod:`fsdp_optim.formats.sharded.side_file`), not in the rank files the optimizer state and weights come from;
this is the walk over them, one saved rank at a time (side files are small: buffers and loop state)::

    side = opened.side_state()            # None: not a whole checkpoint (sharded, or consolidate's file of one)
    side.buffer_names                     ("block1.seen", "norm.running_mean", ...)  as the manifest lists them
    side.per_rank                         False: rank 0's side file holds the buffers; True: every rank its own
    side.parts(1)                         ({"block1.seen": T[4], ...}, {"['rng']": T[5056], "['opt'][0]": T[3]}, values)

``parts(r)``'s buffers are rank 0's unless they were saved per rank; its second dict is ``extra``'s tensors keyed
by where they sit in the tree (``"['rng']"``; the root itself ``""``); its third ``extra``'s other values (its tree,
each tensor a placeholder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import read_rank_side
from fsdp_optim.formats.whole_file import WholeFile

__all__ = ["BUFFER_KEY", "TENSOR", "SideState", "extra_label"]

BUFFER_KEY = "@buffer"  # the key of a buffer's row or finding, beside the weights' "@param"


def extra_label(rank: int) -> str:
    """What a row or finding of saved rank ``rank``'s ``extra`` is named, in place of a parameter's name."""
    return f"extra of rank {rank}"


@dataclass(frozen=True)
class SideState:
    """The buffers and ``extra`` of one whole checkpoint, sharded or consolidated (see the module docstring)."""

    world_size: int  # saved ranks with a side file (1 for consolidate's file: it keeps one rank's extra)
    per_rank: bool  # every rank saved its own buffers (they differed across ranks)
    buffer_names: tuple[str, ...]
    read: Callable[[int], tuple[dict[str, torch.Tensor], Any]]  # saved rank -> (buffers, extra), checked
    holds_extra: bool = True  # False: a layout that keeps no extra at all (Hugging Face's), not an extra of None

    @classmethod
    def of_checkpoint(cls, ckpt: ShardedCheckpoint) -> SideState:
        """The side files of the whole sharded checkpoint ``ckpt``; ``ValueError`` for an optimizer-only one."""
        training = ckpt.manifest.training
        if training is None:
            raise ValueError(f"{ckpt.directory}: an optimizer-only checkpoint has no side files (not a whole one)")
        names = tuple(b.name for b in training.buffers)
        return cls(ckpt.manifest.world_size, training.buffers_per_rank, names,
                   partial(read_rank_side, ckpt.directory, training))  # fmt: skip

    @classmethod
    def of_whole_file(cls, whole: WholeFile) -> SideState:
        """The buffers and ``extra`` of consolidate's file of a whole checkpoint, as saved rank 0's."""
        buffers = whole.buffer_tensors()
        return cls(1, False, tuple(buffers), lambda _: (buffers, whole.extra))

    def parts(self, saved_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
        """``(buffers, extra's tensors by place, extra's other values)`` of saved rank ``saved_rank`` (checked against
        the manifest); the values: ``extra``'s tree with each tensor replaced by :data:`TENSOR` (so that two extras'
        numbers, strings and structure compare apart from their tensors)."""
        buffers, extra = self.read(saved_rank)
        return buffers, dict(_tensors(extra, "")), _values(extra)


TENSOR = "<tensor>"  # where a tensor of extra sits, in :meth:`SideState.parts`' values


def _values(value: Any) -> Any:
    if torch.is_tensor(value):
        return TENSOR
    if isinstance(value, dict):
        return {k: _values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_values(v) for v in value)
    return value


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
