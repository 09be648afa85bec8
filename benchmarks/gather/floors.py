"""Floors: the least work that moves the same optimizer-state bytes, with no bookkeeping at all.

The bytes are exactly what a full Adam dict holds: every rank's *real* elements of every sharded state
tensor (``exp_avg``, ``exp_avg_sq``), padding excluded. Before timing, each rank packs its pieces into one
contiguous buffer, so a floor is one message per rank:

- ``gather``: one ``dist.gather`` of the padded packed shards into buffers preallocated (and touched) on
  the recipient;
- ``p2p_warm``: each rank ``isend``s its packed real elements; the recipient copies its own and
  ``irecv``s the others' into one preallocated, already touched buffer;
- ``p2p_fresh``: the same into a buffer allocated inside the call, so the recipient pays for new pages,
  as any new full dict must. This is the floor the ratios are taken against.

For ``get_shard_from_optim_state_dict``: ``copy`` makes a fresh copy of this rank's padded shards.
On NCCL the packed buffers live on the GPU and the recipient stages each received piece on the GPU before
copying it to host memory (untested here: no GPU machine was available when this was written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_optim.job.root import read_layout as describe


@dataclass
class Shards:
    """This rank's optimizer-state bytes, packed once before any floor is timed."""

    real: torch.Tensor  # this rank's real elements of every sharded state tensor, concatenated
    padded: torch.Tensor  # the same with each shard's padding (equal size on every rank)
    shard_tensors: list[torch.Tensor]  # the live padded shard tensors, for the copy floor
    real_numels: list[int]  # len(real) of every rank
    device: torch.device

    @property
    def full_bytes(self) -> int:
        return sum(self.real_numels) * self.real.element_size()

    @classmethod
    def of(cls, model: nn.Module, optim: torch.optim.Optimizer) -> Shards:
        layout, params = describe(model)
        real, shard_tensors = [], []
        for flat, param in zip(layout.flat_params, params):
            for value in optim.state.get(param, {}).values():
                if torch.is_tensor(value) and value.dim() == 1:
                    shard_tensors.append(value.detach())
                    real.append(value.detach()[: flat.bounds().real])
        if len({t.dtype for t in shard_tensors}) > 1:
            raise NotImplementedError("floors assume one dtype for all optimizer state")
        numels: list[int] = [0] * dist.get_world_size()
        packed = torch.cat(real)
        dist.all_gather_object(numels, packed.numel())
        return cls(packed, torch.cat(shard_tensors), shard_tensors, numels, packed.device)


def _offsets(numels: list[int]) -> list[int]:
    out = [0]
    for n in numels:
        out.append(out[-1] + n)
    return out


def gather(shards: Shards, buffers: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """One ``dist.gather`` into ``buffers`` (preallocated on rank 0, ``None`` elsewhere)."""
    dist.gather(shards.padded, gather_list=buffers, dst=0)
    return buffers


def gather_buffers(shards: Shards) -> list[torch.Tensor] | None:
    if dist.get_rank() != 0:
        return None
    return [torch.zeros_like(shards.padded) for _ in range(dist.get_world_size())]


def p2p(shards: Shards, out: torch.Tensor | None, staging: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """Point-to-point into ``out`` on rank 0: a fresh host buffer when ``out`` is ``None``."""
    rank = dist.get_rank()
    if rank != 0:
        if shards.real.numel():
            dist.isend(shards.real, dst=0).wait()
        return None
    offsets = _offsets(shards.real_numels)
    if out is None:
        out = torch.empty(offsets[-1], dtype=shards.real.dtype)
    out[: offsets[1]].copy_(shards.real)
    works, staged = [], []
    for src in range(1, len(shards.real_numels)):
        if shards.real_numels[src] == 0:
            continue
        destination = out[offsets[src] : offsets[src + 1]]
        buffer = destination if shards.device.type == "cpu" else staging[src]  # type: ignore[index]
        works.append(dist.irecv(buffer, src=src))
        if buffer is not destination:
            staged.append((destination, buffer))
    for work in works:
        work.wait()
    for destination, buffer in staged:
        destination.copy_(buffer)
    return out


def warm_buffers(shards: Shards) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """(host output, device staging) for rank 0, touched once so that no page faults remain."""
    if dist.get_rank() != 0:
        return None, None
    out = torch.zeros(sum(shards.real_numels), dtype=shards.real.dtype)
    staging = None
    if shards.device.type != "cpu":
        staging = [torch.zeros(n, dtype=shards.real.dtype, device=shards.device) for n in shards.real_numels]
    return out, staging


def copy(shards: Shards) -> list[torch.Tensor]:
    """A fresh host copy of this rank's padded shards."""
    return [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in shards.shard_tensors]
