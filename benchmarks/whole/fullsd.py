"""What fairscale users did before a sharded whole-state checkpoint: full state dicts through rank 0.

- ``fullsd_save``: fairscale's ``model.state_dict()`` (every rank gathers the full weights), fairscale 0.4.13's own
  ``gather_full_optim_state_dict`` (the full optimizer state on rank 0; see ``benchmarks/gather/peers.py`` for the step
  tensors it turns into floats, put back untimed) and rank 0 ``torch.save`` + fsync of both in one file;
- ``fullsd_load``: every rank ``torch.load``s that file, ``model.load_state_dict(full["model"])``, fairscale's
  ``get_shard_from_optim_state_dict`` and ``optim.load_state_dict`` into a fresh Adam.

Measured for their peak RSS beside ours (few calls: they are slow, and only their memory is compared).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ckpt.common import Probes, load_method
from ..gather import peers
from ..measure import Method
from ..peak import save_durably


def save_methods(model: nn.Module, optim: torch.optim.Optimizer, *, path: Path) -> dict[str, Method]:
    gather = peers.fairscale(model, optim)

    def call() -> None:
        weights = model.state_dict()
        full = gather.call()
        if dist.get_rank() == 0:
            save_durably({"model": weights, "optim": full}, path)

    return {"fullsd_save": Method(call, finish=gather.finish)}


def load_methods(model: nn.Module, *, path: Path, probes: Probes) -> dict[str, Method]:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    def load(target: torch.optim.Optimizer) -> None:
        full: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(full["model"])
        target.load_state_dict(FairscaleFSDP.get_shard_from_optim_state_dict(model, full["optim"]))

    return {"fullsd_load": load_method("fullsd_load", model, load, lambda _: "", probes)}
