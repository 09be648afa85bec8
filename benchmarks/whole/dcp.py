"""PyTorch's answer for the whole state, as ``Method``s: FSDP2 (``fully_shard``) with Distributed Checkpoint.

The state saved is ``{"model": ..., "optimizer": ...}`` from ``get_state_dict(model, optim)`` (FQN keys,
DTensor shards), and building it is part of every call's time, as it is of a user's.

- ``dcp_save``: ``dcp.save`` (default process group);
- ``dcp_async``: ``dcp.async_save`` on a gloo group of its own (as torchtitan does), thread mode, default stager
  (a CPU copy). Timed: the blocking call; recorded: the time until ``.result()`` returns;
- ``dcp_load_same``: the documented recipe into zeroed weights and a fresh Adam: ``get_state_dict`` (which
  initialises the fresh optimizer's state with one zero-lr step), ``dcp.load``, ``set_state_dict``.

Check: a load must give back this job's live local shards and optimizer state exactly (which also checks
``dcp_save``, whose checkpoint it reads).
"""

from __future__ import annotations

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


def save_methods(
    model: nn.Module, optim: torch.optim.Optimizer, *, directory: Path, async_dir: Path, group: dist.ProcessGroup, probes: Probes
) -> dict[str, Method]:
    return {
        "dcp_save": Method(lambda: dcp.save(_state(model, optim), checkpoint_id=directory)),
        "dcp_async": probes.wrap(
            "dcp_async",
            Method(lambda: dcp.async_save(_state(model, optim), checkpoint_id=async_dir, process_group=group)),
            durable=lambda future: future.result(),
        ),
    }


def load_same(model: nn.Module, optim: torch.optim.Optimizer, *, directory: Path, probes: Probes) -> dict[str, Method]:
    def load(target: torch.optim.Optimizer) -> None:
        state = _state(model, target)
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, target, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return {"dcp_load_same": load_method("dcp_load_same", model, load, same_as(model, snapshot(model), optim), probes)}
