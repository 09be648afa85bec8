"""Reading one rank's sharded optimizer in terms of the model layout, and checking that ranks agree.

Pure: reads ``optim.state_dict()`` output and parameter objects; never writes to either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.elementwise import check_elementwise, state_keys
from fsdp_optim.core.flatten import StateKind, classify_flat_state, same_scalar, show_value
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.records import GroupRecord

__all__ = [
    "LocalState", "check_agreement", "check_optimizer", "group_members", "read_local_state", "summary_digest",
    "viewed_flat", "with_scalars",
]  # fmt: skip


@dataclass(frozen=True)
class LocalState:
    """One rank's optimizer state, keyed by flat parameter index instead of optimizer id.

    ``state[i]`` holds flat parameter ``i``'s live entries (the optimizer's own tensors: read only).
    ``summary[i]`` lists ``(key, kind, dtype or scalar value)`` per entry, a 0-dim tensor summarised as
    ``("tensor", dtype name, value)``; it is plain Python (cheap to pickle) and identical on every rank
    of a healthy job, which :func:`check_agreement` verifies.
    """

    groups: tuple[GroupRecord, ...]
    state: Mapping[int, Mapping[str, Any]]
    summary: Mapping[int, tuple[tuple[str, StateKind, Any], ...]]


def read_local_state(
    layout: ModelLayout,
    params: Sequence[nn.Parameter],
    optim_state: Mapping[str, Any],
    optim_groups: Sequence[Any],
    *,
    read_scalars: bool = True,
) -> LocalState:
    """Map ``optim.state_dict()`` (``optim_state``) and ``optim.param_groups`` onto the layout.

    ``read_scalars=False`` reads no tensor's value (an async save's blocking part: reading a GPU scalar waits for
    all the GPU work queued before it): a 0-dim tensor is summarised as ``("tensor", dtype name, None)`` until
    :func:`with_scalars` reads it from the save's own copy.

    Shapes::

        optim_state = {"state": {local_id: {key: value}}, "param_groups": [{..., "params": [local_id]}]}
        -> LocalState(groups=(GroupRecord(hyperparams, flat_indices, named),), state={flat_index: {key: value}}, ...)

    Per-element state is 1-D in ``state``: the live tensors, viewed flat where the parameter keeps its own shape
    (:attr:`~fsdp_optim.core.layout.FlatParamLayout.shard_shape`).
    """
    members = group_members(optim_groups, params)
    groups: list[GroupRecord] = []
    state: dict[int, Mapping[str, Any]] = {}
    for indices, packed in zip(members, optim_state["param_groups"], strict=True):
        for i, pid in zip(indices, packed["params"], strict=True):
            if optim_state["state"].get(pid):
                state[i] = optim_state["state"][pid]
        hyper = {key: v for key, v in packed.items() if key not in ("params", "param_names")}
        groups.append(GroupRecord(hyper, tuple(indices), named="param_names" in packed))
    summary = {}
    for i, entries in list(state.items()):
        kinds = classify_flat_state(layout.flat_params[i], entries)
        state[i] = entries = viewed_flat(entries, kinds)
        summary[i] = tuple(
            (key, kind, entries[key].dtype if kind is StateKind.SHARDED else _portable(entries[key], read_scalars))
            for key, kind in kinds.items()
        )
    return LocalState(tuple(groups), state, summary)


def viewed_flat(entries: Mapping[str, Any], kinds: Mapping[str, StateKind]) -> Mapping[str, Any]:
    """``entries`` with every per-element tensor viewed 1-D (a view, no copy: optimizer state is contiguous). The
    same mapping when they are 1-D already; a parameter left unflattened at world size 1 keeps its own shape."""
    if all(kind is StateKind.SCALAR or entries[key].dim() == 1 for key, kind in kinds.items()):
        return entries
    return {key: v.reshape(-1) if kinds[key] is StateKind.SHARDED else v for key, v in entries.items()}


def group_members(param_groups: Sequence[Mapping[str, Any]], params: Sequence[nn.Parameter]) -> list[list[int]]:
    """For each of ``optim.param_groups``, the indices into ``params`` of its parameters, in its order; ``ValueError``
    for a parameter that ``params`` does not hold."""
    index_of = {id(p): i for i, p in enumerate(params)}
    members = []
    for k, group in enumerate(param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in index_of]
        if unknown:
            raise ValueError(
                f"optim: param group {k} holds a parameter of shape {unknown[0]} that this FSDP instance does not "
                "own; build the optimizer from the root instance's parameters()"
            )
        members.append([index_of[id(p)] for p in group["params"]])
    return members


def check_optimizer(saved: str | None, optim: torch.optim.Optimizer, source: str) -> None:
    """Refuse loading state ``source`` saved from optimizer class ``saved`` into ``optim`` of another class,
    or into an optimizer that is not elementwise (:mod:`fsdp_optim.core.elementwise`)."""
    check_elementwise(optim, where="optim", keys=state_keys(optim))
    if saved is not None and saved != type(optim).__name__:
        raise ValueError(f"optim: {source} was saved from {saved}, found {type(optim).__name__}")


def _portable(value: Any, read: bool = True) -> Any:
    """A cheap-to-pickle stand-in for a scalar: ``.item()`` is exact for every real dtype (``None`` unless ``read``)."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.item() if read else None)
    return value


def with_scalars(
    summary: Mapping[int, tuple[tuple[str, StateKind, Any], ...]], state: Mapping[int, Mapping[str, Any]]
) -> dict[int, tuple[tuple[str, StateKind, Any], ...]]:
    """``summary`` with each unread 0-dim tensor's value read from ``state`` (``{flat: {key: value}}``, a save's own
    host copy of the live state)."""
    return {
        i: tuple((key, kind, _portable(state[i][key]) if _unread(v) else v) for key, kind, v in entries)
        for i, entries in summary.items()
    }


def _unread(summarised: Any) -> bool:
    """A 0-dim tensor summarised without its value."""
    return isinstance(summarised, tuple) and summarised[:1] == ("tensor",) and summarised[2:] == (None,)


def _show(summarised: Any) -> str:
    if isinstance(summarised, tuple) and len(summarised) == 3 and summarised[0] == "tensor":
        return f"{summarised[2]!r} (torch.{summarised[1]})"
    return show_value(summarised)


def summary_digest(summary: Mapping[int, Any]) -> int:
    """A signed 64-bit digest of a summary, equal on ranks whose summaries are equal (process-independent)."""
    text = repr(sorted(summary.items())).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def check_agreement(layout: ModelLayout, summaries: Sequence[Mapping[int, Any]]) -> None:
    """Raise ``ValueError`` unless every rank has the same state keys, kinds, dtypes and scalar values."""
    reference = summaries[0]
    for rank, summary in enumerate(summaries[1:], start=1):
        if set(summary) != set(reference):
            only = sorted(set(summary) ^ set(reference))
            flat = layout.flat_params[only[0]]
            raise ValueError(
                f"ranks 0 and {rank} disagree on whether {flat.describe()} has optimizer state; did every rank "
                "take the same optimizer steps?"
            )
        for i, entries in summary.items():
            flat = layout.flat_params[i]
            theirs = {key: (kind, v) for key, kind, v in entries}
            ours = {key: (kind, v) for key, kind, v in reference[i]}
            if set(theirs) != set(ours):
                raise ValueError(
                    f"{flat.describe()}: rank 0 has state keys {sorted(ours)}, rank {rank} has {sorted(theirs)}"
                )
            for key, (kind, value) in ours.items():
                other_kind, other = theirs[key]
                same = kind is other_kind and (
                    value == other if kind is StateKind.SHARDED else same_scalar(value, other)
                )
                if not same:
                    raise ValueError(
                        f"optimizer state '{key}' of {flat.describe()} differs across ranks: rank 0 has "
                        f"{_show(value)}, rank {rank} has {_show(other)}"
                    )
