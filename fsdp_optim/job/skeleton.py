"""An object's tensors, for sending it over a process group: taken out (sent as tensors, not pickled) and put back
once received, or all moved to one device. Pure: no collective here (:mod:`fsdp_optim.job.transport` sends).

Only dicts, lists and tuples are walked (rebuilt around what replaces their items); every other value is a leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorSlot", "fill", "moved", "slots", "strip"]


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor sent after the pickled skeleton goes back in."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _rebuilt(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with every leaf replaced by ``leaf(value)``."""
    if isinstance(obj, dict):
        return {key: _rebuilt(value, leaf) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuilt(value, leaf) for value in obj)
    return leaf(obj)


def strip(obj: object, tensors: list[torch.Tensor]) -> object:
    """``obj`` with each tensor of one dimension or more replaced by a :class:`TensorSlot` (the tensor appended to
    ``tensors``): the skeleton that is pickled; the tensors travel as tensors."""

    def take(value: Any) -> Any:
        if not (torch.is_tensor(value) and value.dim() > 0):
            return value
        tensors.append(value.detach())
        return TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)

    return _rebuilt(obj, take)


def slots(obj: object) -> list[TensorSlot]:
    """The skeleton's slots, in the order they are found."""
    found: list[TensorSlot] = []
    _rebuilt(obj, lambda value: found.append(value) if isinstance(value, TensorSlot) else None)
    return found


def fill(obj: object, tensors: list[torch.Tensor]) -> object:
    """A skeleton with each slot replaced by its received tensor."""
    return _rebuilt(obj, lambda value: tensors[value.index] if isinstance(value, TensorSlot) else value)


def moved(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor on ``device`` (those already there are the same objects; the others copies, detached
    from autograd). What the object transport sends: a CUDA tensor pickled by ``broadcast_object_list`` is unpickled
    onto the *sender's* device (``cuda:r``), another rank's GPU (or none, on another node); host tensors unpickle on
    the host of every receiver."""
    return _rebuilt(obj, lambda value: value if not torch.is_tensor(value) or value.device == device
                    else value.detach().to(device))  # fmt: skip
