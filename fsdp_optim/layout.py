"""Typed records of how a model's parameters sit in FSDP's flat, padded per-rank shards.

Everything here is a pure function of the wrapped model's structure: no collective, no data copied.
The records answer three questions for every flat parameter an FSDP instance owns:

- which parameters of the *unwrapped* model it holds, in which order, with which shapes;
- over how many ranks it is sharded and where this rank's real elements start and stop;
- how many padding elements this rank's shard carries at its tail.

Padding is never communicated: FSDP cuts a flat tensor of ``numel`` elements with ``torch.chunk`` into
``world_size`` chunks of ``ceil(numel / world_size)`` elements, so every rank's padding follows from
``numel`` and ``world_size`` alone (:func:`shard_bounds`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = ["FlatParamLayout", "ModelLayout", "ParamSpec", "ShardBounds", "clean_path", "read_layout", "shard_bounds"]

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

    ``rank`` is ``None`` in a rank-independent record (a checkpoint's manifest, a planning source);
    :meth:`at_rank` places it on one rank. :class:`~fsdp_optim.manifest.FlatRecord` adds saved state.
    """

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
        assert rank is not None, f"{self.describe()}: a rank-independent record needs an explicit rank"
        return shard_bounds(self.numel, self.world_size, rank)

    def at_rank(self, rank: int) -> FlatParamLayout:
        """This record as ``rank`` holds it (a unit that is not sharded is the same on every rank: rank 0)."""
        return replace(self, rank=rank if self.world_size > 1 else 0)

    def padding(self) -> list[int]:
        """Padding elements per rank, derived from ``numel`` and ``world_size``."""
        return [self.bounds(r).padding for r in range(self.world_size)]

    @property
    def shard_numel(self) -> int:
        return self.bounds().numel

    def describe(self) -> str:
        """A short human label for error messages."""
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
        """This layout as rank ``rank`` sees it (units that are not sharded stay at rank 0)."""
        return replace(self, flat_params=tuple(f.at_rank(rank) for f in self.flat_params), rank=rank)

    def order_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.param_order)}

    def per_rank_units(self) -> list[str]:
        """Units whose state differs per rank (see :attr:`FlatParamLayout.per_rank`)."""
        return sorted({f.unit for f in self.flat_params if f.per_rank})

    def check_world_sizes(self) -> None:
        """Raise ``ValueError`` unless every unit is sharded over the root's world size or not at all."""
        for flat in self.flat_params:
            if flat.world_size not in (1, self.world_size):
                raise ValueError(
                    f"{flat.describe()} is sharded over {flat.world_size} ranks but the root FSDP instance over "
                    f"{self.world_size}; nested units must use the root's world size or 1"
                )


def clean_path(path: str) -> str:
    """Drop fairscale's wrapper segments: ``"_fsdp_wrapped_module._fpw_module.2.w"`` -> ``"2.w"``."""
    return ".".join(part for part in path.split(".") if part and part not in _WRAPPER_SEGMENTS)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _fsdp_instances(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from fairscale.nn import FullyShardedDataParallel

    for path, module in root.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            yield path, module


def read_layout(root: nn.Module) -> tuple[ModelLayout, list[nn.Parameter]]:
    """Read the layout of a fairscale-FSDP-wrapped ``root`` and the live parameters it describes.

    Returns ``(layout, params)`` where ``params[i]`` is the parameter object (what the optimizer holds)
    whose layout is ``layout.flat_params[i]``. Works before any forward pass.
    """
    # Module order of the unwrapped model: the wrapped tree visits modules in the same order, with
    # wrapper modules mapping onto the path of the module they wrap.
    module_rank: dict[str, int] = {}
    for path, _ in root.named_modules():
        module_rank.setdefault(clean_path(path), len(module_rank))

    flats: list[FlatParamLayout] = []
    live: list[nn.Parameter] = []
    order_keys: dict[str, tuple[int, int]] = {}
    root_world_size = root.world_size  # type: ignore[attr-defined]
    for path, instance in _fsdp_instances(root):
        unit = clean_path(path)
        for index, param in enumerate(instance.params):
            if getattr(param, "_is_shared", False):
                raise NotImplementedError(
                    f"FSDP unit '{unit}' holds a parameter shared with another FSDP instance "
                    "(append_shared_param); fsdp_optim does not support cross-instance sharing"
                )
            if hasattr(param, "_param_infos"):  # a FlatParameter
                names = [clean_path(_join(unit, module_name, attr)) for module_name, _, attr in param._param_infos]
                shapes = [tuple(s) for s in param._param_shapes]
                flattened = True
            else:
                names = [clean_path(_join(unit, instance._param_name_groups[index][0]))]
                shapes = [tuple(param._orig_size)]
                flattened = False
            specs, offset = [], 0
            for name, shape in zip(names, shapes):
                specs.append(ParamSpec(name, shape, offset))
                offset += math.prod(shape)
                owner = name.rpartition(".")[0]
                order_keys[name] = (module_rank.get(owner, len(module_rank)), len(order_keys))
            sharded = bool(param._is_sharded)
            flats.append(
                FlatParamLayout(
                    unit=unit,
                    params=tuple(specs),
                    world_size=instance.world_size if sharded else 1,
                    rank=instance.rank if sharded else 0,
                    dtype=param.dtype,
                    flattened=flattened,
                    # Not sharded inside a larger world: its process group is this rank alone (MoE experts).
                    per_rank=not sharded and root_world_size > 1,
                )
            )
            live.append(param)
    order = tuple(sorted(order_keys, key=order_keys.__getitem__))
    return ModelLayout(tuple(flats), order, root_world_size, root.rank), live  # type: ignore[attr-defined]
