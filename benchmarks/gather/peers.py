"""The gathers being compared: ours (two transports) and three peers, each as a ``Method``.

- ``ours``: ``fsdp_optim`` default, ``gather_full_optim_state_dict(optim)`` (tensor transport, rank 0);
- ``ours_object``: the design card's path, ``transport="object"`` (one ``broadcast_object_list`` per rank);
- ``fairscale``: fairscale 0.4.13's own ``gather_full_optim_state_dict``, called unbound on the same
  (fsdp_optim-wrapped) model; it needs the forward pass that training has done;
- ``fsdp1``: PyTorch FSDP1 ``FSDP.full_optim_state_dict(model, optim, rank0_only=True)``;
- ``fsdp2``: PyTorch FSDP2 (``fully_shard``) with DCP's
  ``get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``;
- ``get_shard``: ours, ``get_shard_from_optim_state_dict(full, optim=optim)`` (local).

PyTorch's models are separate instances built from the same seed and trained on the same batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..measure import Method


def ours(model: nn.Module, optim: torch.optim.Optimizer) -> Method:
    return Method(lambda: model.gather_full_optim_state_dict(optim))


def ours_object(model: nn.Module, optim: torch.optim.Optimizer) -> Method:
    return Method(lambda: model.gather_full_optim_state_dict(optim, transport="object"))


def get_shard(model: nn.Module, optim: torch.optim.Optimizer, full: dict[str, Any]) -> Method:
    return Method(lambda: model.get_shard_from_optim_state_dict(full, optim=optim))


def fairscale(model: nn.Module, optim: torch.optim.Optimizer) -> Method:
    """fairscale's gather, with an untimed ``finish`` that repairs what it breaks.

    It replaces the live optimizer's ``step`` tensors by Python floats, after which its own next call fails
    (``assert type(bufs["step"]) is int or ...``) and ours would read floats; ``finish`` puts them back.
    """
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    steps = {p: s["step"].clone() for p, s in optim.state.items() if torch.is_tensor(s.get("step"))}

    def restore_steps() -> None:
        for param, step in steps.items():
            optim.state[param]["step"] = step.clone()

    def call() -> Any:
        if dist.get_world_size() == 1:
            raise RuntimeError("needs W > 1: it reads _full_param_padded, which fairscale creates only when sharding")
        return FairscaleFSDP.gather_full_optim_state_dict(model, optim)

    return Method(call, finish=restore_steps)


def fsdp1(model: nn.Module, optim: torch.optim.Optimizer) -> Method:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return Method(lambda: FSDP1.full_optim_state_dict(model, optim, rank0_only=True))


def fsdp2(model: nn.Module, optim: torch.optim.Optimizer) -> Method:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return Method(lambda: get_optimizer_state_dict(model, optim, options=options))
