"""Whole-state floors: the least work that writes or reads the bytes a whole checkpoint holds for one rank.

- ``save``: each rank ``torch.save``s its flat weight shards (``p.data`` of every flat parameter, padding
  included) and its ``optim.state_dict()`` to one file of its own, flushed and ``fsync``-ed;
- ``load``: each rank ``torch.load``s (``weights_only=True``) that file back into fresh memory.

``own_bytes`` is what the RSS targets compare with: the storage bytes of a rank's weight shards and optimizer
state tensors, the bytes a load must allocate afresh (and a save need not allocate at all).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..peak import save_durably


def rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"floor-rank{rank}.pt"


def own_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"weights": [p.data for p in model.parameters()], "optim": optim.state_dict()}


def own_bytes(model: nn.Module, optim: torch.optim.Optimizer | None) -> int:
    """This rank's weight shards and optimizer state in bytes; with ``optim=None``, Adam's (two tensors like each
    parameter, one scalar step) as a fresh Adam holds it once loaded."""
    params = list(model.parameters())
    weights = sum(p.untyped_storage().nbytes() for p in params)
    if optim is None:
        return 3 * weights + 4 * len(params)
    state = [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
    return weights + sum(t.untyped_storage().nbytes() for t in state)


def save(model: nn.Module, optim: torch.optim.Optimizer, directory: str | os.PathLike[str], rank: int) -> Path:
    return save_durably(own_state(model, optim), rank_file(directory, rank))


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
