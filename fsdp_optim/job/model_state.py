"""The live model's own state as a whole checkpoint reads and writes it: weight shards and persistent buffers.

Public torch API only (``named_modules``, ``named_buffers``, ``Parameter.data``); fairscale's private attributes
stay in :mod:`fsdp_optim.job.root`. Names are those of the unwrapped model (wrapper segments dropped).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash
from torch import nn

from fsdp_optim.core.layout import clean_path, join_path
from fsdp_optim.job.root import Root
from fsdp_optim.job.stager import pieces

__all__ = ["buffers_digest", "live_shaped", "persistent_buffers", "weight_shards"]


def weight_shards(root: Root) -> dict[int, torch.Tensor]:
    """``{flat index: this rank's padded 1-D shard}``: the live parameters' data (the fp32 master shard under
    mixed precision), not copied; a parameter left unflattened at world size 1, which fairscale keeps in its own
    shape, viewed flat. ``ValueError`` when a parameter is not in its sharded state (inside ``summon_full_params``
    or a forward pass), naming its unit."""
    shards = {}
    for i, (flat, param) in enumerate(zip(root.layout.flat_params, root.params, strict=True)):
        data = param.data
        if tuple(data.shape) != flat.shard_shape:
            raise ValueError(
                f"{flat.describe()}: its parameter has shape {tuple(data.shape)}, expected this rank's shard of shape "
                f"{flat.shard_shape}; save or load between training steps, outside summon_full_params and forward"
            )
        shards[i] = data.reshape(-1)
    return shards


def live_shaped(root: Root, index: int, shard: torch.Tensor) -> torch.Tensor:
    """A 1-D shard of ``root.params[index]`` viewed in the live parameter's shape."""
    shape = root.layout.flat_params[index].shard_shape
    return shard if tuple(shard.shape) == shape else shard.view(shape)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: buffer}`` for every buffer that ``unwrapped_model.state_dict()`` would hold (non-persistent
    buffers left out), in module order; a buffer shared by several modules appears under its first name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in skip or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out[clean_path(join_path(path, name))] = buffer
    return out


def buffers_digest(buffers: Mapping[str, torch.Tensor]) -> str:
    """One digest of every buffer's name, dtype, shape and bytes (compared across ranks, never stored); GPU buffers
    read through the stager's pinned ring."""
    names = sorted(buffers)
    h = xxhash.xxh3_128(repr([(n, str(buffers[n].dtype), tuple(buffers[n].shape)) for n in names]).encode())
    parts = [buffers[n].detach().reshape(-1) for n in names if buffers[n].numel()]
    for piece in pieces(parts) if parts else ():  # the bytes in order: the shapes above say where each ends
        h.update(memoryview(piece.numpy()))  # type: ignore[arg-type]
    return f"xxh3-128:{h.hexdigest()}"
