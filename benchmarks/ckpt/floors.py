"""Checkpoint floors: the least work that writes or reads the same optimizer-state bytes, no bookkeeping.

- ``save``: each rank ``torch.save``s its own ``optim.state_dict()`` (the flat shards its FSDP instance
  holds, padding included: the bytes any sharded checkpoint must write) to one file, flushed and
  ``fsync``-ed. The floor of a sync save, and of an async save's time until durable.
- ``load``: each rank ``torch.load``s (``weights_only=True``) that file back into fresh memory.
- ``read_all_write_all(files, parts, out)``: one process reads every rank's file, copies every state
  tensor once into ``parts`` fresh buffers of equal size and writes each with ``torch.save`` + ``fsync``.
  ``parts=1`` is the floor of offline consolidation plus saving the full dict; ``parts=M`` the floor of
  an offline reshard to M ranks. Both read each byte once, copy it once and write it once, as any
  offline tool must (the copy strips padding and re-cuts the shards). ``into_parts`` is that copy (scale's floors
  share it).
- The whole-state floor saves ``own_state`` (flat weight shards + optimizer state) the same way; ``own_bytes`` is
  what its RSS targets compare with: the storage bytes of a rank's weight shards and optimizer state.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..peak import save_durably


def rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"floor-rank{rank}.pt"


def save(state: Any, directory: str | os.PathLike[str], rank: int) -> Path:
    """``state`` (``optim.state_dict()``; the whole-state floor: ``own_state``) into this rank's file, durably."""
    return save_durably(state, rank_file(directory, rank))


def own_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """What the whole-state floor saves: this rank's flat weight shards (padding included) and optimizer state."""
    return {"weights": [p.data for p in model.parameters()], "optim": optim.state_dict()}


def own_bytes(model: nn.Module, optim: torch.optim.Optimizer | None) -> int:
    """This rank's weight shards and optimizer state in bytes (what the whole-state RSS targets compare with); with
    ``optim=None``, Adam's (two tensors like each parameter, one scalar step) as a fresh Adam holds it once loaded."""
    params = list(model.parameters())
    weights = sum(p.untyped_storage().nbytes() for p in params)
    if optim is None:
        return 3 * weights + 4 * len(params)
    return weights + sum(v.untyped_storage().nbytes() for s in optim.state.values() for v in s.values() if torch.is_tensor(v))


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _tensors(state_dict: dict[str, Any]) -> Iterator[torch.Tensor]:
    for entry in state_dict["state"].values():
        for value in entry.values():
            if torch.is_tensor(value) and value.dim() > 0:
                yield value.reshape(-1)


def state_numel(files: Sequence[Path]) -> tuple[int, torch.dtype]:
    """Elements and dtype of every state tensor in ``files`` (read before timing: headers only, mapped)."""
    tensors = [t for f in files for t in _tensors(torch.load(f, mmap=True, weights_only=True))]
    if len({t.dtype for t in tensors}) > 1:
        raise NotImplementedError("the floor assumes one dtype for all optimizer state")
    return sum(t.numel() for t in tensors), tensors[0].dtype


def into_parts(tensors: Iterable[torch.Tensor], parts: int, numel: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The ``numel`` elements of ``tensors``, as one stream, copied once into ``parts`` fresh buffers of equal size."""
    bounds = [numel * k // parts for k in range(parts + 1)]
    outs = [torch.empty(bounds[k + 1] - bounds[k], dtype=dtype) for k in range(parts)]
    cursor = 0
    for tensor in tensors:
        start, stop = cursor, cursor + tensor.numel()
        for k in range(max(bisect.bisect_right(bounds, start) - 1, 0), parts):  # the output pieces this tensor overlaps
            lo, hi = max(start, bounds[k]), min(stop, bounds[k + 1])
            if lo >= hi:
                break
            outs[k][lo - bounds[k] : hi - bounds[k]].copy_(tensor.reshape(-1)[lo - start : hi - start])
        cursor = stop
    return outs


def read_all_write_all(files: Sequence[Path], parts: int, out_dir: str | os.PathLike[str], *, numel: int, dtype: torch.dtype) -> list[Path]:
    """Read ``files`` one at a time, copy their ``numel`` state elements into ``parts`` fresh buffers, write each."""
    outs = into_parts((t for f in files for t in _tensors(load(f))), parts, numel, dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [save_durably(out, out_dir / f"part{k}.pt") for k, out in enumerate(outs)]
