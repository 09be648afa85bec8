"""PyTorch's answer for the whole state, as ``Method``s: FSDP2 (``fully_shard``) with Distributed Checkpoint.

The state saved is ``{"model": ..., "optimizer": ...}`` from ``get_state_dict(model, optim)`` (FQN keys,
DTensor shards), and building it is part of every call's time, as it is of a user's.

- ``dcp_save``: ``dcp.save`` (default process group);
- ``dcp_async``: ``dcp.async_save`` on a gloo group of its own (as torchtitan does), thread mode, default stager
  (a CPU copy). Timed: the blocking call; recorded: the time until ``.result()`` returns;
- ``dcp_load_same``: the documented recipe into zeroed weights and a fresh Adam: ``get_state_dict`` (which
  initialises the fresh optimizer's state with one zero-lr step), ``dcp.load``, ``set_state_dict``.

Check: a load must give back this job's live local shards and optimizer state exactly (which also checks
``dcp_save``, whose checkpoint it reads). Where: a local directory, or an object store through DCP's
``FsspecWriter`` / ``FsspecReader`` (``location``), which the storage benchmark uses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..ckpt.common import Probes
from ..measure import Method
from .fresh import load_method, same_as, snapshot


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optim)
    return {"model": model_state, "optimizer": optim_state}


def location(directory: Path | None = None, *, url: str = "", options: dict[str, Any] | None = None) -> Callable[[bool], dict[str, Any]]:
    """Where DCP saves and loads: ``location(write)`` gives ``dcp.save`` / ``dcp.load``'s keywords, a local
    ``directory`` or, with ``url``, a fresh ``FsspecWriter`` / ``FsspecReader`` (with ``options``) per call."""
    if directory is not None:
        return lambda write: {"checkpoint_id": directory}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return lambda write: {"storage_writer": FsspecWriter(url, **(options or {}))} if write else {"storage_reader": FsspecReader(url, **(options or {}))}


def save_methods(model: nn.Module, optim: torch.optim.Optimizer, *, where: Callable[[bool], dict[str, Any]], probes: Probes,
                 async_dir: Path | None = None, group: dist.ProcessGroup | None = None) -> dict[str, Method]:  # fmt: skip
    """``dcp_save`` (and, with ``async_dir``, ``dcp_async`` on ``group``)."""
    methods = {"dcp_save": Method(lambda: dcp.save(_state(model, optim), **where(True)))}
    if async_dir is not None:
        call = Method(lambda: dcp.async_save(_state(model, optim), checkpoint_id=async_dir, process_group=group))
        methods["dcp_async"] = probes.wrap("dcp_async", call, durable=lambda future: future.result())
    return methods


def load_same(model: nn.Module, optim: torch.optim.Optimizer, *, where: Callable[[bool], dict[str, Any]], probes: Probes) -> dict[str, Method]:
    def load(target: torch.optim.Optimizer) -> None:
        state = _state(model, target)
        dcp.load(state, **where(False))
        set_state_dict(model, target, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return {"dcp_load_same": load_method("dcp_load_same", model, load, same_as(model, snapshot(model), optim), probes)}
