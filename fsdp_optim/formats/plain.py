"""A plain (non-FSDP) optimizer's ``state_dict()`` given the parameter names a full dict needs.

A plain torch optimizer numbers its parameters 0, 1, ... group by group, each group's parameters in the
order they were handed to it; its ``state_dict()`` holds no names. A full dict (:mod:`fsdp_optim.formats.fullstate`)
is that same dict plus ``"param_names": {id: name}``, which :func:`name_optimizer_state` adds::

    optim = torch.optim.Adam(model.parameters())           # or param groups built from named_parameters()
    full = fsdp_optim.name_optimizer_state(optim.state_dict(), model)
    fsdp_optim.get_shard_from_optim_state_dict(fsdp_model, full)   # or scatter_full_optim_state, reshard, ...

The names are the model's ``named_parameters()`` (tied parameters once). With ``optimizer=`` (the live
optimizer the dict came from) each id gets the name of the very tensor its group holds, whatever the groups'
order. Without it the ids, taken group by group, get the names in ``named_parameters()`` order: right for
``Adam(model.parameters())`` and for groups that are consecutive runs of ``named_parameters()``; for other
groups pass ``optimizer=`` (a wrong guess is caught where the shapes differ, not where they agree). Offline,
``--param-names FILE`` gives the same names as JSON: a list of names, or an object ``{name: shape}``
(``json.dump({n: list(p.shape) for n, p in model.named_parameters()}, f)``), whose shapes are then checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn

__all__ = ["ParamNames", "name_optimizer_state", "name_plain_dict", "param_names_file"]

# What names a plain optimizer's parameters: the module it was built over, the names, or {name: shape}.
ParamNames: TypeAlias = nn.Module | Sequence[str] | Mapping[str, Sequence[int]]

_FSDP_NAMES = ("_fsdp_wrapped_module", "flat_param")


def name_optimizer_state(
    optim_state_dict: Mapping[str, Any],
    model: ParamNames,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """A plain optimizer's ``state_dict()`` with ``"param_names"`` added (a new dict; the tensors are shared)::

        {"state": {0: {...}, ...}, "param_groups": [{"params": [0, 1]}, {"params": [2]}]}  + a model of a, b, c
        -> the same dict with "param_names": {0: "a", 1: "b", 2: "c"}

    ``model``: the unwrapped module, its parameter names in ``named_parameters()`` order, or ``{name: shape}``;
    ``optimizer``: the live optimizer (with a module). ``ValueError`` for an FSDP-wrapped module, a dict that
    already names its parameters, or one that does not fit the model (naming the id, the parameter, both shapes)."""
    return name_plain_dict(optim_state_dict, model, optimizer=optimizer, where="optim_state_dict")


def name_plain_dict(
    optim_state_dict: Mapping[str, Any], model: ParamNames, *, optimizer: torch.optim.Optimizer | None, where: str
) -> dict[str, Any]:
    """:func:`name_optimizer_state`, its errors naming ``where`` (a file's path, for the command line)."""
    _check_plain(optim_state_dict, where)
    names, shapes = _names_and_shapes(model)
    by_name = dict(zip(names, shapes)) if shapes is not None else None
    if optimizer is not None:
        names = _by_identity(optimizer, model, len(names))
    ids = [pid for group in optim_state_dict["param_groups"] for pid in sorted(group["params"])]
    if len(ids) != len(names) or len(set(ids)) != len(ids):
        raise ValueError(
            f"{where}: its param groups hold {len(ids)} parameter ids ({len(set(ids))} distinct), but the model has "
            f"{len(names)} parameters (named_parameters(), tied ones once); expected the optimizer built over "
            f"this model's parameters, each once"
        )
    param_names = dict(zip(ids, names))
    if by_name is not None:
        _check_shapes(optim_state_dict["state"], param_names, by_name, where)
    return {**optim_state_dict, "param_names": param_names}


def _check_plain(obj: object, where: str) -> None:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("state"), Mapping) or not isinstance(
        obj.get("param_groups"), (list, tuple)
    ):
        found = f"keys {sorted(map(str, obj))[:20]}" if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(f"{where}: expected an optimizer's state_dict() ('state' and 'param_groups'), found {found}")
    if "param_names" in obj:
        raise ValueError(f"{where}: already names its parameters ('param_names'); it is a full dict as it is")
    for i, group in enumerate(obj["param_groups"]):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)) or not all(type(p) is int for p in params):
            raise ValueError(f"{where}: param_groups[{i}]['params'] must be a list of int ids, found {params!r:.80}")


def _by_identity(optimizer: torch.optim.Optimizer, model: object, count: int) -> list[str]:
    """The names of the optimizer's parameters in its own order (group by group), by tensor identity."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: with optimizer=, expected the module it was built over, found {type(model)}")
    by_id = {id(p): n for n, p in model.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(held) if id(p) not in by_id]
    if unknown:
        raise ValueError(
            f"optimizer: its parameter {unknown[0]} (of {len(held)}, group by group) is none of the model's "
            f"{count} named_parameters(); expected the optimizer built over this model"
        )
    return [by_id[id(p)] for p in held]


def _names_and_shapes(model: object) -> tuple[list[str], list[tuple[int, ...]] | None]:
    if isinstance(model, nn.Module):
        named = list(model.named_parameters())
        flat = [n for n, _ in named if any(part in n for part in _FSDP_NAMES)]
        if flat:
            raise ValueError(
                f"model: an FSDP-wrapped module (flat parameter {flat[0]!r}); name the state with the unwrapped "
                "module the plain optimizer was built over"
            )
        return [n for n, _ in named], [tuple(p.shape) for _, p in named]
    if isinstance(model, Mapping):
        return [str(n) for n in model], [tuple(int(d) for d in s) for s in model.values()]
    if isinstance(model, Sequence) and not isinstance(model, str) and all(isinstance(n, str) for n in model):
        return list(model), None
    raise TypeError(f"model: expected a module, a list of parameter names or {{name: shape}}, found {type(model)}")


def _check_shapes(
    state: Mapping[Any, Any], param_names: Mapping[int, str], shapes: Mapping[str, tuple[int, ...]], where: str
) -> None:
    errors = []
    for pid, entries in state.items():
        name = param_names.get(pid)
        if name is None:
            errors.append(f"state id {pid!r} is in no param group")
            continue
        for key, value in entries.items() if isinstance(entries, Mapping) else ():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shapes[name]:
                errors.append(
                    f"id {pid} ({name}): state '{key}' has shape {list(value.shape)}, expected the parameter's "
                    f"{list(shapes[name])}"
                )
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ValueError(
            f"{where}: does not fit the model's parameters in the optimizer's order: {'; '.join(errors[:5])}{more}"
        )


def param_names_file(path: str | os.PathLike[str]) -> list[str] | dict[str, list[int]]:
    """``--param-names FILE``: a JSON list of names, or an object ``{name: shape}``, checked for its form."""
    from fsdp_optim.disk.json_input import loads

    where = f"param_names: {path}"
    with open(path, "rb") as f:
        text = f.read(64 << 20)
    try:
        value = loads(text, where=where)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return value
    if isinstance(value, dict) and all(
        isinstance(s, list) and all(type(d) is int and d >= 0 for d in s) for s in value.values()
    ):
        return value
    raise ValueError(
        f"{where}: expected a JSON list of parameter names or an object {{name: [shape]}}, found a "
        f"{type(value).__name__} of another form"
    )
