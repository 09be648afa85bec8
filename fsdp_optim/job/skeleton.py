"""An object's skeleton for sending it over a process group: its tensors taken out (sent as tensors, not pickled),
and put back once received. Pure: no collective here (:mod:`fsdp_optim.job.transport` sends both parts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorSlot", "fill", "slots", "strip"]


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor sent after the pickled skeleton goes back in."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def strip(obj: object, tensors: list[torch.Tensor]) -> object:
    """``obj`` with each tensor of one dimension or more replaced by a :class:`TensorSlot` (the tensor appended to
    ``tensors``): the skeleton that is pickled; the tensors travel as tensors."""
    if torch.is_tensor(obj) and obj.dim() > 0:
        tensors.append(obj.detach())
        return TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(strip(v, tensors) for v in obj)
    return obj


def slots(obj: object) -> list[TensorSlot]:
    if isinstance(obj, TensorSlot):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in slots(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in slots(v)]
    return []


def fill(obj: object, tensors: list[torch.Tensor]) -> object:
    """A skeleton with each slot replaced by its received tensor."""
    if isinstance(obj, TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(fill(v, tensors) for v in obj)
    return obj
