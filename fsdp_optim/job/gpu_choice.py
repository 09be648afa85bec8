"""Which GPU a rank's NCCL object collectives use (:func:`fsdp_optim.job.transport.object_device`): the group's bound
device (``init_process_group(device_id=...)``), else ``LOCAL_RANK``'s GPU (torchrun starts one rank per GPU), else
the current one. Never GPU 0 on every rank of a job that did not call ``torch.cuda.set_device``: torch's own object
collectives take ``current_device()``, which is GPU 0 there. The first time the choice is not ``current_device()``,
a warning says so (once per process: the first save)."""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["checked", "choose", "mismatch"]

_warned: list[torch.device] = []  # the device the one warning named


def choose(bound: torch.device | None, local_rank: str | None, gpus: int, current: int) -> torch.device:
    """The bound device, else ``LOCAL_RANK % gpus``, else ``current`` (pure: the tests pass a device count)."""
    if bound is not None:
        return bound
    if local_rank is not None and gpus > 0:
        return torch.device("cuda", int(local_rank) % gpus)
    return torch.device("cuda", current)


def mismatch(device: torch.device, current: int) -> str:
    """The warning's text."""
    return (
        f"checkpoint collectives use {device} (the group's bound device, or LOCAL_RANK's GPU) but "
        f"torch.cuda.current_device() is {current}: call torch.cuda.set_device({device.index}) before training, "
        "or this rank's other CUDA work lands on another GPU than its collectives"
    )


def checked(bound: torch.device | None, *, gpus: int | None = None, current: int | None = None) -> torch.device:
    """:func:`choose` with this process's ``LOCAL_RANK``, GPU count and current device (or those given), warning
    once per process where the choice is not the current device."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    current = torch.cuda.current_device() if current is None else current
    device = choose(bound, os.environ.get("LOCAL_RANK"), gpus, current)
    if device.index != current and not _warned:
        _warned.append(device)
        warnings.warn(mismatch(device, current), RuntimeWarning, stacklevel=3)
    return device
