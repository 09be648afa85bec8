"""The FSDP root as fsdp_optim sees it: the only reader of fairscale FSDP's private attributes besides the host switch.

``read_layout`` turns a wrapped model's flat parameters into a :class:`~fsdp_optim.core.layout.ModelLayout`;
``check_root`` refuses anything but a root instance.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch import nn

from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec, clean_path, join_path


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
                names = [clean_path(join_path(unit, module_name, attr)) for module_name, _, attr in param._param_infos]
                shapes = [tuple(s) for s in param._param_shapes]
                flattened = True
            else:
                names = [clean_path(join_path(unit, instance._param_name_groups[index][0]))]
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


def check_root(fsdp: Any) -> None:
    """Refuse anything but the root instance of a fairscale ``FullyShardedDataParallel`` (or a subclass)."""
    from fairscale.nn import FullyShardedDataParallel

    if not isinstance(fsdp, FullyShardedDataParallel):
        raise TypeError(f"fsdp: expected a fairscale FullyShardedDataParallel root, found {type(fsdp).__name__}")
    if fsdp._is_root is False:
        raise ValueError("fsdp: expected the root FSDP instance, found a nested one; call this on the root")
