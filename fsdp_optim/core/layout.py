"""Typed records of how a model's parameters sit in FSDP's flat, padded per-rank shards: for every flat parameter
an FSDP instance owns, which parameters of the *unwrapped* model it holds (order, shapes), over how many ranks it is
sharded, and where this rank's real elements and padding lie.

Padding is never communicated: FSDP cuts a flat tensor of ``numel`` elements with ``torch.chunk`` into
``world_size`` chunks of ``ceil(numel / world_size)`` elements, so every rank's padding follows from
``numel`` and ``world_size`` alone (:func:`shard_bounds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fsdp_optim.core.intervals import padding_per_rank

__all__ = ["FlatParamLayout", "ModelLayout", "ParamSpec", "ShardBounds", "clean_path", "shard_bounds"]

# Path segments that fairscale inserts between a module and its children.
_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})


@dataclass(frozen=True)
class ShardBounds:
    """One rank's piece of an unpadded flat tensor: real elements ``[start, stop)`` then ``padding`` zeros."""

    start: int
    stop: int
    padding: int

    @property
    def real(self) -> int:
        return self.stop - self.start

    @property
    def numel(self) -> int:
        """Elements in the rank's padded shard (the same on every rank)."""
        return self.real + self.padding


def shard_bounds(numel: int, world_size: int, rank: int) -> ShardBounds:
    """Where ``rank`` sits in a flat tensor of ``numel`` elements cut like ``torch.chunk`` into ``world_size``.

    >>> shard_bounds(5, 4, 2), shard_bounds(5, 4, 3)
    (ShardBounds(start=4, stop=5, padding=1), ShardBounds(start=5, stop=5, padding=2))
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    chunk = math.ceil(numel / world_size)
    start = min(rank * chunk, numel)
    stop = min(start + chunk, numel)
    return ShardBounds(start, stop, chunk - (stop - start))


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the unwrapped model inside a flat parameter."""

    name: str  # fully qualified name in the unwrapped model, e.g. "layers.0.weight"
    shape: tuple[int, ...]
    offset: int  # first element in the unpadded flat tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatParamLayout:
    """One parameter as FSDP holds it: several unwrapped parameters flattened (or one, unflattened).
    :class:`~fsdp_optim.core.records.FlatRecord` adds saved state."""

    unit: str  # unwrapped path of the owning FSDP instance; "" for the root
    params: tuple[ParamSpec, ...]
    world_size: int  # ranks it is sharded over; 1 when the instance does not shard it
    rank: int | None  # this process's rank among them; None when the record is rank-independent
    dtype: torch.dtype
    flattened: bool  # True for a FlatParameter, False for a parameter left as it is
    # True for a unit over a process group of its own rank only inside a larger world (MoE experts):
    # every rank holds different values for the same names, so every rank's copy is kept.
    per_rank: bool = False

    @property
    def numel(self) -> int:
        """Elements of the unpadded flat tensor."""
        return sum(p.numel for p in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def bounds(self, rank: int | None = None) -> ShardBounds:
        rank = self.rank if rank is None else rank
        if rank is None:
            raise ValueError(f"rank: {self.describe()} is rank-independent, expected an explicit rank, found None")
        return shard_bounds(self.numel, self.world_size, rank)

    def at_rank(self, rank: int) -> FlatParamLayout:
        """This record as ``rank`` holds it (a unit that is not sharded: rank 0)."""
        return replace(self, rank=rank if self.world_size > 1 else 0)

    def padding(self) -> list[int]:
        """Padding elements per rank."""
        return padding_per_rank(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        return self.bounds().numel

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of a live rank's shard: ``(shard_numel,)``, except for a parameter left unflattened and not
        sharded (world size 1, or a unit of its own rank), which fairscale keeps in its own shape (its
        ``_shard_parameters_`` neither flattens nor pads it). Its ``shard_numel`` elements are the same either way:
        a reader views such a shard flat, a loader writes it back in this shape."""
        if self.flattened or self.world_size > 1:
            return (self.shard_numel,)
        return self.params[0].shape

    def describe(self) -> str:
        head = ", ".join(self.names[:3]) + (", ..." if len(self.params) > 3 else "")
        return f"FSDP unit '{self.unit or '<root>'}' ({'flat' if self.flattened else 'unflattened'}: {head})"


@dataclass(frozen=True)
class ModelLayout:
    """Every flat parameter of a wrapped model, in FSDP-instance order, plus the unwrapped parameter order."""

    flat_params: tuple[FlatParamLayout, ...]
    param_order: tuple[str, ...]  # what ``unwrapped_model.named_parameters()`` would yield, in order
    world_size: int  # the root instance's
    rank: int

    def at_rank(self, rank: int) -> ModelLayout:
        return replace(self, flat_params=tuple(f.at_rank(rank) for f in self.flat_params), rank=rank)

    def order_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.param_order)}

    def per_rank_units(self) -> list[str]:
        """Units whose state differs per rank (see :attr:`FlatParamLayout.per_rank`)."""
        return sorted({f.unit for f in self.flat_params if f.per_rank})

    def world_size_errors(self) -> list[str]:
        """One message per unit sharded over neither the root's world size nor 1."""
        return [
            f"{flat.describe()} is sharded over {flat.world_size} ranks but the root FSDP instance over "
            f"{self.world_size}; nested units must use the root's world size or 1"
            for flat in self.flat_params
            if flat.world_size not in (1, self.world_size)
        ]

    def check_world_sizes(self) -> None:
        """Raise ``ValueError`` unless every unit is sharded over the root's world size or not at all."""
        if errors := self.world_size_errors():
            raise ValueError(errors[0])


def clean_path(path: str) -> str:
    """Drop fairscale's wrapper segments: ``"_fsdp_wrapped_module._fpw_module.2.w"`` -> ``"2.w"``."""
    return ".".join(part for part in path.split(".") if part and part not in _WRAPPER_SEGMENTS)


def join_path(*parts: str) -> str:
    return ".".join(p for p in parts if p)


