"""Pure tensor transforms between full per-parameter state and flat, padded per-rank shards.

Vocabulary, for one flat parameter of ``numel`` elements sharded over ``W`` ranks (see
:class:`~fsdp_optim.core.layout.FlatParamLayout`):

- *flat full*: a 1-D tensor of ``numel`` elements, the parameters' state concatenated in flat order;
- *shard*: a 1-D tensor of ``ceil(numel / W)`` elements, rank ``r``'s slice of the flat full followed by
  its padding (zeros);
- *split*: one tensor per parameter, shaped like that parameter.
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from fsdp_optim.core.layout import FlatParamLayout

__all__ = ["StateKind", "assemble", "classify_flat_state", "clone_value", "same_scalar", "show_value", "split"]


class StateKind(str, Enum):
    SHARDED = "sharded"  # a tensor shaped like the flat shard: one element per parameter element
    SCALAR = "scalar"  # a 0-dim tensor or a Python value shared by every parameter (step, mu_product, ...)


def classify_flat_state(layout: FlatParamLayout, state: Mapping[str, Any]) -> dict[str, StateKind]:
    """Kind of each optimizer state entry of one flat parameter's local shard.

    A shard-shaped tensor is 1-D of ``shard_numel`` elements, or of the live shard's own shape
    (:attr:`~fsdp_optim.core.layout.FlatParamLayout.shard_shape`: a parameter left unflattened at world size 1).
    Raises ``NotImplementedError`` for a tensor that is neither shard-shaped nor 0-dim (for example a
    factored second moment), since such state cannot be unflattened into per-parameter tensors, and for any
    state of a 0-dim parameter kept in its own shape, whose per-element state cannot be told from a scalar.
    """
    kinds: dict[str, StateKind] = {}
    flat, live = (layout.shard_numel,), layout.shard_shape
    if live == () and state:
        raise NotImplementedError(
            f"{layout.describe()} is a 0-dim parameter that fairscale keeps unflattened and unsharded: its optimizer "
            f"state per element ({sorted(state)}) is 0-dim like a scalar such as 'step', so fsdp_optim cannot tell "
            "them apart; wrap it with flatten_parameters=True"
        )
    for key, value in state.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            kinds[key] = StateKind.SCALAR
        elif tuple(value.shape) in (flat, live):
            kinds[key] = StateKind.SHARDED
        else:
            shapes = f"{live}" if live == flat else f"{live} (viewed flat: {flat})"
            raise NotImplementedError(
                f"optimizer state '{key}' of {layout.describe()} has shape {tuple(value.shape)}; expected this "
                f"rank's shard's shape {shapes} or a 0-dim scalar"
            )
    return kinds


def clone_value(value: Any) -> Any:
    """An independent copy of a state or hyperparameter value (tensors on CPU, detached)."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def same_scalar(a: Any, b: Any) -> bool:
    """Whether two scalar states are the same value, bit for bit: tensors of one dtype, shape and bytes,
    Python floats of one bit pattern (so NaN equals the same NaN, and 0.0 differs from -0.0), other
    values equal and of one type; tuples and lists element by element."""
    if torch.is_tensor(a) and torch.is_tensor(b):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        if a.dtype.is_floating_point or a.dtype.is_complex:  # bytes, not ==: NaN is NaN
            return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return bool(torch.equal(a, b))
    if torch.is_tensor(a) or torch.is_tensor(b) or type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_scalar(x, y) for x, y in zip(a, b))
    return bool(a == b)


def show_value(value: object) -> str:
    """A scalar state for an error message: ``2.0 (torch.float32)`` for a 0-dim tensor, ``repr`` otherwise."""
    if torch.is_tensor(value):
        if value.dim() != 0:
            return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
        return f"{value.item()!r} ({value.dtype})"
    return repr(value)


def split(layout: FlatParamLayout, flat_full: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat_full`` (``numel`` elements), one per parameter, shaped like the parameter."""
    if flat_full.numel() != layout.numel:
        raise ValueError(f"{layout.describe()}: flat tensor has {flat_full.numel()} elements, expected {layout.numel}")
    return [flat_full[p.offset : p.offset + p.numel].view(p.shape) for p in layout.params]


def assemble(layout: FlatParamLayout, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new flat full tensor from every rank's padded shard (rank order), padding dropped."""
    if len(shards) != layout.world_size:
        raise ValueError(f"{layout.describe()}: got {len(shards)} shards, expected {layout.world_size}")
    pieces = []
    for rank, shard in enumerate(shards):
        bounds = layout.bounds(rank)
        if shard.numel() != bounds.numel:
            raise ValueError(
                f"{layout.describe()}: rank {rank}'s shard has {shard.numel()} elements, expected {bounds.numel}"
            )
        pieces.append(shard.reshape(-1)[: bounds.real])
    return torch.cat(pieces).cpu()
