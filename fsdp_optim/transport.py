"""The one module that talks to ``torch.distributed``.

Two ways to bring per-rank flat shards together:

- :func:`gather_flat_tensors` (the default): every rank sends the *real* elements of each of its shards,
  padding excluded, straight into the slice of a freshly allocated flat full tensor on the recipient.
  Each byte moves once; ranks other than the recipient allocate nothing (on CPU/gloo they send views
  of their live optimizer state). Cost: one point-to-point message per (flat parameter, state key,
  sending rank) with real elements.
- :func:`broadcast_from_each_rank`: the design card's ``broadcast_object_list`` path, one broadcast per
  rank of that rank's pickled shard dict. Every rank receives every shard; kept for comparison.

Small metadata travels with one :func:`all_gather_objects` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .layout import ShardBounds

__all__ = ["Transfer", "all_gather_objects", "broadcast_from_each_rank", "gather_flat_tensors"]

# On NCCL, staging buffers on the GPU are flushed once this many bytes are in flight.
_STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class Transfer:
    """One state entry of one flat parameter, to be reassembled from every rank's shard."""

    numel: int  # elements of the unpadded flat full tensor
    dtype: torch.dtype
    bounds: tuple[ShardBounds, ...]  # per rank of the group; a single entry when the unit is not sharded
    local: torch.Tensor  # this rank's padded shard; read, never written


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` on every rank (one collective)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_each_rank(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` on every rank, one ``broadcast_object_list`` per rank (W collectives)."""
    received = []
    for src in range(dist.get_world_size(group)):
        box = [obj if src == dist.get_rank(group) else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(_group(group), src), group=group)
        received.append(box[0])
    return received


def gather_flat_tensors(
    transfers: Sequence[Transfer], *, recipient: int | None, group: dist.ProcessGroup | None
) -> list[torch.Tensor] | None:
    """Reassemble each transfer's flat full tensor (CPU, padding dropped) on ``recipient``.

    ``recipient`` is a rank of ``group``; ``None`` assembles on every rank (one broadcast per piece
    instead of one message). Returns the tensors in ``transfers`` order where assembled, else ``None``.
    """
    rank = dist.get_rank(group)
    receiving = recipient is None or rank == recipient
    device = _comm_device(group)
    outputs: list[torch.Tensor] = []
    pending: list[Any] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination slice on CPU, buffer on device)
    staged_bytes = 0

    def flush() -> None:
        nonlocal staged_bytes
        for work in pending:
            work.wait()
        for destination, buffer in staged:
            destination.copy_(buffer)
        pending.clear()
        staged.clear()
        staged_bytes = 0

    for transfer in transfers:
        out = torch.empty(transfer.numel, dtype=transfer.dtype) if receiving else None
        if out is not None:
            outputs.append(out)
        if len(transfer.bounds) == 1:  # not sharded: every rank holds it all
            if out is not None:
                out.copy_(transfer.local[: transfer.numel])
            continue
        for src, bounds in enumerate(transfer.bounds):
            if bounds.real == 0:
                continue
            if src == rank:
                piece = transfer.local[: bounds.real]
                if out is not None:
                    out[bounds.start : bounds.stop].copy_(piece)
                if recipient is None:
                    pending.append(_broadcast(piece.to(device), src, group))
                elif rank != recipient:
                    pending.append(dist.isend(piece.to(device), dst=_global(group, recipient), group=group))
            elif receiving:
                destination = out[bounds.start : bounds.stop]  # type: ignore[index]
                buffer = destination if device.type == "cpu" else torch.empty_like(destination, device=device)
                if buffer is not destination:
                    staged.append((destination, buffer))
                    staged_bytes += buffer.numel() * buffer.element_size()
                if recipient is None:
                    pending.append(_broadcast(buffer, src, group))
                else:
                    pending.append(dist.irecv(buffer, src=_global(group, src), group=group))
        if staged_bytes > _STAGING_BYTES:
            flush()
    flush()
    return outputs if receiving else None


def _broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> Any:
    return dist.broadcast(tensor, src=_global(group, src), group=group, async_op=True)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(_group(group), rank)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
