"""The FSDP root as fsdp_optim sees it: the only reader of fairscale FSDP's private attributes besides the host switch.

Every entry point calls :func:`verify_root` once and reads the typed :class:`Root` it returns (layout, live
parameters, process group, rank, world size), never the FSDP module's attributes. ``read_layout`` turns a
wrapped model's flat parameters into a :class:`~fsdp_optim.core.layout.ModelLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec, clean_path, join_path
from fsdp_optim.job.local import group_members
from fsdp_optim.job.transport import ProcessGroup

__all__ = ["Root", "check_root", "read_aliases", "read_layout", "unsharded_parameters", "verify_root"]

_T = TypeVar("_T")


@dataclass(frozen=True, eq=False)  # eq=False: parameters compare by identity, not elementwise
class Root:
    """A fairscale FSDP root instance, checked once and read once: everything the entry points need.

    For a root over 2 ranks with one nested unit (the root's own parameters, then ``layers.0``), at rank 1::

        Root(layout=ModelLayout(flat_params=(<unit ''>, <unit 'layers.0'>), ..., world_size=2, rank=1),
             params=(FlatParameter[ceil(n0/2)], FlatParameter[ceil(n1/2)]),  # layout.flat_params order
             positions=(0, 1),        # params[i]'s index in fsdp.parameters()
             group=<ProcessGroup>, rank=1, world_size=2,
             members=((0, 1),))       # with an optimizer: flat indices per param group; else None
    """

    layout: ModelLayout  # at this rank: layout.rank == rank, layout.world_size == world_size
    params: tuple[nn.Parameter, ...]  # the live parameters the optimizer holds; params[i] is layout.flat_params[i]
    positions: tuple[int, ...]  # params[i]'s index in fsdp.parameters() (past the end for one it does not yield)
    group: ProcessGroup  # the root's process group: every collective of an entry point runs on it
    rank: int  # this process's rank in ``group``
    world_size: int  # ``group``'s size
    members: tuple[tuple[int, ...], ...] | None  # per ``optim.param_groups``: indices into ``params``; None without


def verify_root(fsdp: Any, optim: torch.optim.Optimizer | None = None) -> Root:
    """Refuse anything but a fairscale FSDP root (:func:`check_root`), then read it (and ``optim``'s param groups)
    into a :class:`Root`. Local: no collective."""
    check_root(fsdp)
    layout, params = read_layout(fsdp)
    position = {id(p): i for i, p in enumerate(fsdp.parameters())}
    members = None if optim is None else tuple(tuple(m) for m in group_members(optim.param_groups, params))
    return Root(
        layout=layout,
        params=tuple(params),
        positions=tuple(position.get(id(p), len(position)) for p in params),
        group=_read(fsdp, "process_group", ProcessGroup, "<root>"),
        rank=layout.rank,
        world_size=layout.world_size,
        members=members,
    )


def check_root(fsdp: Any) -> None:
    """Refuse anything but the root instance of a fairscale ``FullyShardedDataParallel`` (or a subclass)."""
    from fairscale.nn import FullyShardedDataParallel

    if not isinstance(fsdp, FullyShardedDataParallel):
        raise TypeError(f"fsdp: expected a fairscale FullyShardedDataParallel root, found {type(fsdp).__name__}")
    if fsdp._is_root is False:
        raise ValueError("fsdp: expected the root FSDP instance, found a nested one; call this on the root")


def unsharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters that no nested fairscale FSDP instance has sharded yet (the user's own, in their
    own dtype): fairscale marks the ones it has taken over with ``_is_sharded``."""
    return [p for p in module.parameters() if not hasattr(p, "_is_sharded")]


def _read(instance: nn.Module, name: str, kind: type[_T], unit: str) -> _T:
    """fairscale FSDP's attribute ``name`` of ``instance``, checked to be a ``kind`` (fairscale 0.4.x sets it)."""
    value = getattr(instance, name, None)
    if not isinstance(value, kind):
        raise TypeError(
            f"FSDP unit '{unit}': expected fairscale FSDP's attribute '{name}' of type {kind.__name__}, found "
            f"{type(value).__name__}; fsdp_optim reads fairscale 0.4.x's FullyShardedDataParallel"
        )
    return value


def _fsdp_instances(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from fairscale.nn import FullyShardedDataParallel

    for path, module in root.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            yield path, module


def read_layout(root: nn.Module) -> tuple[ModelLayout, list[nn.Parameter]]:
    """``(layout, params)`` of a fairscale-FSDP-wrapped ``root``: ``params[i]`` (what the optimizer holds) is laid
    out as ``layout.flat_params[i]``. Works before any forward pass."""
    # Module order of the unwrapped model: the wrapped tree visits modules in the same order, with
    # wrapper modules mapping onto the path of the module they wrap.
    module_rank: dict[str, int] = {}
    for path, _ in root.named_modules():
        module_rank.setdefault(clean_path(path), len(module_rank))

    flats: list[FlatParamLayout] = []
    live: list[nn.Parameter] = []
    order_keys: dict[str, tuple[int, int]] = {}
    root_world_size = _read(root, "world_size", int, "<root>")
    for path, instance in _fsdp_instances(root):
        unit = clean_path(path)
        for index, param in enumerate(_read(instance, "params", list, unit)):
            flat, names = _flat_layout(instance, unit, index, param, per_rank_possible=root_world_size > 1)
            for name in names:
                owner = name.rpartition(".")[0]
                order_keys[name] = (module_rank.get(owner, len(module_rank)), len(order_keys))
            flats.append(flat)
            live.append(param)
    order = tuple(sorted(order_keys, key=order_keys.__getitem__))
    return ModelLayout(tuple(flats), order, root_world_size, _read(root, "rank", int, "<root>")), live


def _flat_layout(
    instance: nn.Module, unit: str, index: int, param: Any, *, per_rank_possible: bool
) -> tuple[FlatParamLayout, list[str]]:
    """The layout of ``instance.params[index]`` (a FlatParameter or a parameter left unflattened) and its names."""
    if getattr(param, "_is_shared", False):
        raise NotImplementedError(
            f"FSDP unit '{unit}' holds a parameter shared with another FSDP instance "
            "(append_shared_param); fsdp_optim does not support cross-instance sharing"
        )
    if hasattr(param, "_param_infos"):  # a FlatParameter
        names = [clean_path(join_path(unit, module_name, attr)) for module_name, _, attr in param._param_infos]
        shapes = [tuple(s) for s in param._param_shapes]
        flattened = True
    else:
        name_groups = _read(instance, "_param_name_groups", list, unit)
        names = [clean_path(join_path(unit, name_groups[index][0]))]
        shapes = [tuple(param._orig_size)]
        flattened = False
    specs, offset = [], 0
    for name, shape in zip(names, shapes):
        specs.append(ParamSpec(name, shape, offset))
        offset += math.prod(shape)
    sharded = bool(param._is_sharded)
    flat = FlatParamLayout(
        unit=unit,
        params=tuple(specs),
        world_size=_read(instance, "world_size", int, unit) if sharded else 1,
        rank=_read(instance, "rank", int, unit) if sharded else 0,
        dtype=param.dtype,
        flattened=flattened,
        # Not sharded inside a larger world: its process group is this rank alone (MoE experts).
        per_rank=not sharded and per_rank_possible,
    )
    return flat, names


def read_aliases(root: nn.Module, layout: ModelLayout) -> tuple[tuple[str, str], ...]:
    """``(alias, parameter)`` for every tied parameter: a name under which ``unwrapped_model.state_dict()`` holds
    a parameter that :attr:`ModelLayout.param_order` lists under another name (``head.weight`` -> ``embed.weight``).

    A flattened unit records its ties in the flat parameter (fairscale's ``_shared_param_infos``); an
    unflattened one keeps the parameter object under both names.
    """
    known = set(layout.param_order)
    aliases: dict[str, str] = {}
    for path, instance in _fsdp_instances(root):
        unit = clean_path(path)
        for param in _read(instance, "params", list, unit):
            for module_name, prim_name, _, attr, _, prim_attr in getattr(param, "_shared_param_infos", ()):
                alias = clean_path(join_path(unit, module_name, attr))
                aliases[alias] = clean_path(join_path(unit, prim_name, prim_attr))
    by_object: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(param), []).append(clean_path(name))
    for names in by_object.values():
        primary = next((n for n in names if n in known), None)
        for name in names:
            if primary is not None and name != primary and name not in known:
                aliases[name] = primary
    return tuple(sorted((a, p) for a, p in aliases.items() if a not in known and p in known))
