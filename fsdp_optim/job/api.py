"""Gather and cut optimizer state for ANY fairscale FSDP root: fairscale's own class, a subclass such as
fairseq's ``FullyShardedDataParallel``, a model wrapped by ``auto_wrap``, or ours. No re-wrapping.

Orchestration only: the layout comes from :mod:`fsdp_optim.core.layout`, checks and cuts from
:mod:`fsdp_optim.core.plan`, local state from :mod:`.local`, and the bytes move through :mod:`.transport`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from fsdp_optim.core.elementwise import check_elementwise, state_keys
from fsdp_optim.core.execute import cut_rank, optimizer_state_dict
from fsdp_optim.core.flatten import StateKind, assemble
from fsdp_optim.core.layout import ModelLayout, ShardBounds
from fsdp_optim.core.plan import plan
from fsdp_optim.core.preconditions import check_rank
from fsdp_optim.core.source import Plan
from fsdp_optim.formats.fairscale import dict_source
from fsdp_optim.formats.fullstate import build_full_state
from fsdp_optim.formats.kinds import full_file_source
from fsdp_optim.job.local import (
    LocalState,
    check_agreement,
    check_optimizer,
    read_local_state,
    summary_digest,
)
from fsdp_optim.job.root import Root, verify_root
from fsdp_optim.job.transport import (
    ProcessGroup,
    Transfer,
    all_gather_digests,
    all_gather_objects,
    broadcast_from_each_rank,
    gather_flat_tensors,
)

__all__ = ["gather_full_optim_state_dict", "get_shard_from_optim_state_dict"]


def gather_full_optim_state_dict(
    fsdp: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    recipient_rank: int | None = 0,
    transport: Literal["tensor", "object"] = "tensor",
) -> dict[str, Any] | None:
    """Collect the sharded optimizer state into one full dict, in terms of the unwrapped model.

    A collective over ``fsdp``'s process group: every rank must call it, with the root FSDP instance
    and the optimizer built over its ``parameters()``; no forward pass is needed.

    Args:
        fsdp: the root instance of fairscale's ``FullyShardedDataParallel`` or of any subclass.
        optim: the sharded optimizer. Read only: neither it nor its state is modified.
        recipient_rank: rank (in ``fsdp``'s process group) that receives the dict; ``None`` for every rank.
        transport: ``"tensor"`` (default) sends each rank's real shard elements once, point to
            point, into fresh memory on the recipient; ranks other than the recipient allocate
            nothing. ``"object"`` pickles each rank's shards with one ``broadcast_object_list`` per
            rank, so every rank receives everything (slower; kept for comparison).

    Returns:
        On the recipient(s) the full dict (all tensors on CPU; format in :mod:`fsdp_optim.formats.fullstate`)::

            {"state": {id: {"step": tensor(7.), "exp_avg": Tensor[*shape], ...}},
             "param_groups": [{"lr": ..., "params": [ids]}],
             "param_names": {id: "fully.qualified.name"},
             "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": W, "scalar_keys": [...]}}

        ``None`` on other ranks.

    Cost (``"tensor"``): one all-gather of an 8-byte digest of each rank's state summary (the
    summaries themselves only if ranks disagree), then one message per (flat parameter, tensor state
    key, rank holding real elements), carrying the state's bytes once, and a final barrier.
    """
    root = verify_root(fsdp)
    check_elementwise(optim, where="optim", keys=state_keys(optim))  # every rank alike, before any collective
    check_rank("recipient_rank", recipient_rank, root.world_size, allow_none=True)
    if transport not in ("tensor", "object"):
        raise ValueError(f"transport: expected 'tensor' or 'object', found {transport!r}")
    layout = root.layout
    layout.check_world_sizes()
    local = read_local_state(layout, root.params, optim.state_dict(), optim.param_groups)
    if transport == "object":
        flat_tensors = _gather_objects(layout, local, recipient_rank, root.rank, root.group)
    else:
        flat_tensors = _gather_tensors(layout, local, recipient_rank, root.world_size, root.group)
    if flat_tensors is None:
        return None
    ranks = range(root.world_size) if layout.per_rank_units() else []
    flat_states = _flat_states(layout, local, flat_tensors, None)
    per_rank = {r: _flat_states(layout, local, flat_tensors, r) for r in ranks}
    return build_full_state(layout, local.groups, flat_states, optimizer=type(optim).__name__, per_rank=per_rank)


def _flat_states(
    layout: ModelLayout,
    local: LocalState,
    flat_tensors: Mapping[tuple[int, str, int | None], torch.Tensor],
    rank: int | None,
) -> dict[int, dict[str, Any]]:
    """``{flat: {key: flat full tensor or scalar}}`` of the shared flats (``rank`` None) or rank ``rank``'s own."""
    return {
        i: {
            key: flat_tensors[(i, key, rank)] if kind is StateKind.SHARDED else local.state[i][key]
            for key, kind, _ in local.summary[i]
        }
        for i in local.state
        if layout.flat_params[i].per_rank == (rank is not None)
    }


def get_shard_from_optim_state_dict(
    fsdp: nn.Module,
    full_optim_state_dict: Mapping[str, Any] | str | os.PathLike[str],
    *,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's piece of a full dict, ready for ``optim.load_state_dict``. Local: no collective.

    Works at any world size and any wrapping of the same model: the full dict names parameters by
    their unwrapped names. One plan checks that every parameter is present with the right shape and
    dtype, that no param group splits a flat parameter, that nested units are sharded like the root
    (or not at all), and raises ``ValueError`` naming the parameter with what was expected and what was
    found. The input is never modified; every returned tensor is new.

    Args:
        fsdp: the root instance of fairscale's ``FullyShardedDataParallel`` or of any subclass.
        full_optim_state_dict: from :func:`gather_full_optim_state_dict`, a plain optimizer's
            ``state_dict()`` with a ``"param_names"`` map added
            (:func:`~fsdp_optim.name_optimizer_state`), or fairscale's own gathered dict
            (``param_id_map``, ``uncollected_local_ids``; this model must be wrapped as it was then);
            or the path of a file holding one, or of a named safetensors file (``to_safetensors``), of
            which only this rank's byte ranges are read (and checked).
        optim: the sharded optimizer it will be loaded into. When given, param ids follow its
            param groups' order and its group membership is checked against the dict's; otherwise
            the ids follow ``fsdp.parameters()`` order within each of the dict's groups.

    Returns ``{"state": {local_id: {key: padded shard or scalar}}, "param_groups": [...]}``; a shard is shaped as the
    live optimizer holds it: 1-D, or the parameter's own shape where fairscale keeps a parameter unflattened and
    unsharded (``flatten_parameters=False`` at world size 1).
    """
    root = verify_root(fsdp, optim)
    the_plan = full_plan(
        root, full_optim_state_dict, optim, required=[p.requires_grad for p in root.params], order=root.positions
    )
    return optimizer_state_dict(the_plan, cut_rank(the_plan, root.rank))


def full_plan(
    root: Root, full: Mapping[str, Any] | str | os.PathLike[str], optim: torch.optim.Optimizer | None, *,
    required: Sequence[bool] | None = None, order: Sequence[int] | None = None,
) -> Plan:  # fmt: skip
    """The one plan of a full dict handed to a live model (in memory, or a file of a kind
    :func:`~fsdp_optim.formats.kinds.full_file_source` serves), checked against ``optim``, planned for ``root``."""
    optimizer = type(optim).__name__ if optim is not None else None
    if not isinstance(full, (str, os.PathLike)):  # a dict, or what dict_source refuses by name
        source = dict_source(full, root.layout, label="the full dict", optimizer=optimizer)
    else:  # which kinds serve: formats/kinds.py decides
        source = full_file_source(full, root.layout, optimizer=optimizer)
    if optim is not None:
        check_optimizer(source.optimizer, optim, "the full optimizer state dict")
    else:
        keys = {e.key for flat in source.flats for e in flat.state}
        check_elementwise(source.optimizer, where="the full optimizer state dict", keys=keys)
    return plan(source, root.layout, members=root.members, required=required, order=order)


# ---------------------------------------------------------------------------------------------------
# The two transports of the gather


def _gather_tensors(
    layout: ModelLayout, local: LocalState, recipient_rank: int | None, world_size: int, group: ProcessGroup
) -> dict[tuple[int, str, int | None], torch.Tensor] | None:
    """Flat full tensors keyed ``(flat, key, None)``, and ``(flat, key, r)`` for rank r's per-rank flats."""
    if world_size > 1:
        digests = all_gather_digests(summary_digest(local.summary), group)
        if len(set(digests)) > 1:  # only then pay for the full summaries, to say what differs
            check_agreement(layout, all_gather_objects(local.summary, group))
    transfers: list[Transfer] = []
    keys: list[tuple[int, str, int | None]] = []
    for i in sorted(local.state):
        flat = layout.flat_params[i]
        for key, kind, dtype in local.summary[i]:
            if kind is not StateKind.SHARDED:
                continue
            mine = local.state[i][key].detach()
            if flat.per_rank:  # each rank sends its own copy whole: one transfer per rank
                for r in range(world_size):
                    bounds = tuple(ShardBounds(0, flat.numel if s == r else 0, 0) for s in range(world_size))
                    transfers.append(Transfer(flat.numel, dtype, bounds, mine))
                    keys.append((i, key, r))
            else:
                bounds = tuple(flat.bounds(r) for r in range(flat.world_size))
                transfers.append(Transfer(flat.numel, dtype, bounds, mine))
                keys.append((i, key, None))
    gathered = gather_flat_tensors(transfers, recipient=recipient_rank, group=group)
    return None if gathered is None else dict(zip(keys, gathered))


def _gather_objects(
    layout: ModelLayout, local: LocalState, recipient_rank: int | None, rank: int, group: ProcessGroup
) -> dict[tuple[int, str, int | None], torch.Tensor] | None:
    received = broadcast_from_each_rank((local.summary, _shards(local)), group)
    check_agreement(layout, [summary for summary, _ in received])
    if recipient_rank is not None and rank != recipient_rank:
        return None
    out: dict[tuple[int, str, int | None], torch.Tensor] = {}
    for (i, key), own in _shards(local).items():
        flat = layout.flat_params[i]
        if flat.per_rank:
            for r, (_, shards) in enumerate(received):
                out[(i, key, r)] = shards[(i, key)][: flat.numel].to("cpu", copy=True)
        elif flat.world_size == 1:
            out[(i, key, None)] = own[: flat.numel].to("cpu", copy=True)
        else:
            out[(i, key, None)] = assemble(flat, [shards[(i, key)] for _, shards in received])
    return out


def _shards(local: LocalState) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (i, key): local.state[i][key].detach()
        for i, entries in local.summary.items()
        for key, kind, _ in entries
        if kind is StateKind.SHARDED
    }
