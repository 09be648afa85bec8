"""Every tensor inside a nested object (dicts, lists, tuples) on one device: what the object transport sends.

Pure (no collective). A CUDA tensor pickled by ``broadcast_object_list`` is unpickled onto the *sender's* device
(``cuda:r``): a receiver then holds tensors on another rank's GPU (or fails, where that GPU is on another node), and
``torch.cat`` of parts from two devices raises. Host tensors unpickle on the host of every receiver.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["moved"]


def moved(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor on ``device`` (those already there are the same objects; the others copies, detached
    from autograd); dicts, lists and tuples rebuilt around them, every other value as it is."""
    if torch.is_tensor(obj):
        return obj if obj.device == device else obj.detach().to(device)
    if isinstance(obj, dict):
        return {key: moved(value, device) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(value, device) for value in obj)
    return obj
