"""Checks across the rank files of a fairseq/metaseq shard set, and which optimizer id is which parameter; pure,
on the outlines :func:`~fsdp_optim.formats.fairseq.files.summarise` reads. Every refusal names the file (and unit,
parameter or id), expected vs found.

- :func:`check_same_save`: every file comes from the same save of the same model (metadata, model keys,
  param groups, state keys and scalars such as ``step``, optimizer extras, ``num_updates``);
- :func:`check_shards`: every backing parameter is sharded over the set's ranks (a unit on a process group
  of one rank is refused), every tensor's size and every recorded padding checked against that;
- :func:`optimizer_ids`: which optimizer id is which parameter (:func:`match_optimizer_ids`), which the files do not
  record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp_optim.core.checksums import digest
from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.flatten import StateKind, clone_value, same_scalar, show_value
from fsdp_optim.core.layout import shard_bounds
from fsdp_optim.core.records import StateEntry
from fsdp_optim.formats.fairseq.files import Backing, RankSummary

__all__ = [
    "check_same_save",
    "check_shards",
    "match_optimizer_ids",
    "model_aliases",
    "optimizer_ids",
    "resolve_param_order",
    "fairseq_state_entries",
]

ParamOrder = Sequence[str] | None  # the unwrapped model's names, in named_parameters() order


# ---------------------------------------------------------------------------------------------------
# Matching optimizer ids to backing parameters (pure)


def match_optimizer_ids(
    groups: Sequence[Sequence[int]], numels: Mapping[int, int], flat_numels: Sequence[int], *, label: str
) -> dict[int, int]:
    """The one assignment ``{optimizer id: flat index}`` in which each param group lists its flats in index
    order, every id with state (``numels[id]``: its tensors' elements per rank) sits on a flat of that shard
    size (``flat_numels``), and every id is placed; flats in no group hold no state.

    Forward dynamic programme over the flats, with one position per group; counts stop at 2. Raises
    ``ValueError`` when no assignment or several fit, naming them.
    """
    sizes = tuple(len(g) for g in groups)
    # layer[pos] = (ways, previous pos (() at the start, never followed), group that took this flat or -1)
    layers: list[dict[tuple[int, ...], tuple[int, tuple[int, ...], int]]] = [{(0,) * len(groups): (1, (), -1)}]
    remaining = sum(sizes)
    for f, size in enumerate(flat_numels):
        nxt: dict[tuple[int, ...], tuple[int, tuple[int, ...], int]] = {}
        for pos, (ways, _, _) in layers[-1].items():
            placed = sum(pos)
            if remaining - placed <= len(flat_numels) - f - 1:  # enough flats left: this one may be skipped
                _add(nxt, pos, ways, pos, -1)
            for k, group in enumerate(groups):
                if pos[k] < sizes[k] and numels.get(group[pos[k]], size) == size:
                    _add(nxt, pos[:k] + (pos[k] + 1,) + pos[k + 1 :], ways, pos, k)
        layers.append(nxt)
    final = layers[-1].get(sizes)
    if final is None:
        shown = ", ".join(f"id {i}: {numels[i]}" for g in groups for i in g if i in numels)
        raise ValueError(
            f"{label}: the optimizer's param groups (sizes {list(sizes)}) do not fit the FSDP parameters: no order-"
            f"preserving assignment gives every id a parameter of its state's size (elements per rank: {shown}; "
            f"parameters: {list(flat_numels)}); pass optimizer_keys to name them"
        )
    if final[0] > 1:
        raise ValueError(
            f"{label}: cannot tell which FSDP parameters the optimizer holds: several assignments of its "
            f"{sum(sizes)} ids to the {len(flat_numels)} parameters fit their sizes; pass optimizer_keys to name them"
        )
    out: dict[int, int] = {}
    pos = sizes
    for f in range(len(flat_numels), 0, -1):
        _, prev, k = layers[f][pos]
        if k >= 0:
            out[groups[k][pos[k] - 1]] = f - 1
        pos = prev
    return out


def _add(layer: dict, pos: tuple[int, ...], ways: int, prev: tuple[int, ...], k: int) -> None:
    if pos in layer:
        layer[pos] = (min(2, layer[pos][0] + ways), *layer[pos][1:])
    else:
        layer[pos] = (min(2, ways), prev, k)


# ---------------------------------------------------------------------------------------------------
# Checks across ranks


def check_same_save(summaries: Sequence[RankSummary]) -> None:
    first = summaries[0]
    for s in summaries[1:]:
        hint = "(shards of different saves or models?)"
        if s.metadata_key != first.metadata_key or s.structure != first.structure or s.buffers != first.buffers:
            raise ValueError(f"{s.path}: its FSDP metadata describes other parameters than {first.path}'s {hint}")
        # Shapes are checked against the metadata, per rank (check_shards), which says more.
        if {k: v[1] for k, v in s.model.items()} != {k: v[1] for k, v in first.model.items()}:
            raise ValueError(f"{s.path}: its 'model' keys or dtypes differ from {first.path}'s {hint}")
        if [ids for _, ids in s.groups] != [ids for _, ids in first.groups] or _digest_groups(s) != _digest_groups(
            first
        ):
            raise ValueError(f"{s.path}: its optimizer param_groups differ from {first.path}'s {hint}")
        if s.extras != first.extras or s.extras_digest != first.extras_digest:
            raise ValueError(f"{s.path}: optimizer extras {list(s.extras)} differ from {first.path}'s {hint}")
        if s.num_updates != first.num_updates:
            raise ValueError(
                f"{s.path}: num_updates is {s.num_updates!r}, {first.path} has {first.num_updates!r} {hint}"
            )
        if set(s.state) != set(first.state):
            raise ValueError(
                f"{s.path}: optimizer state for ids {sorted(s.state)}, {first.path} has {sorted(first.state)} {hint}"
            )
        for pid, entries in first.state.items():
            if set(s.state[pid]) != set(entries):
                raise ValueError(
                    f"{s.path}: optimizer state keys of id {pid} are {sorted(s.state[pid])}, {first.path} has "
                    f"{sorted(entries)} {hint}"
                )
            for key, value in entries.items():
                found = s.state[pid][key]
                if not (found == value if isinstance(value, tuple) else same_scalar(found, value)):
                    raise ValueError(
                        f"{s.path}: optimizer state '{key}' of id {pid} is {_show(found)}, {first.path} has "
                        f"{_show(value)} {hint}"
                    )


def _digest_groups(s: RankSummary) -> str:
    return digest([dict(hyper) for hyper, _ in s.groups])


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tensor {value[1]}{list(value[0])}"
    return show_value(value)


def check_shards(summaries: Sequence[RankSummary], order: Sequence[int]) -> set[tuple[int, int]]:
    """Every backing parameter (``order``: file order) is sharded over the set's ranks: each rank's tensor has
    its shard's size and the recorded padding is its shard's. Returns the ``(backing, rank)`` pairs where
    fairscale left an unflattened parameter that forward never used whole."""
    first, n = summaries[0], len(summaries)
    backings = [first.backings[i] for i in order]
    for instance in sorted({b.instance for b in backings}) if n > 1 else ():
        members = [(i, b) for i, b in enumerate(first.backings) if b.instance == instance]
        if not any(math.prod(s.model[b.key][0]) < b.numel or s.padding[i] > 0 for s in summaries for i, b in members):
            unit = members[0][1].unit or "<root>"
            raise NotImplementedError(
                f"{first.path}: FSDP unit '{unit}' is not sharded over the set's {n} ranks (a process group of one "
                "rank, as for mixture-of-experts layers): its state may differ per rank, which shard sets do not "
                "support"
            )
    whole: set[tuple[int, int]] = set()
    for f, (i, b) in enumerate(zip(order, backings)):
        for rank, s in enumerate(summaries):
            shape = s.model[b.key][0]
            bounds = shard_bounds(b.numel, n, rank)
            own_shape = not b.flattened and shape == b.params[0].shape
            if n > 1 and own_shape and bounds.numel != b.numel:
                whole.add((f, rank))
            elif math.prod(shape) != bounds.numel or not (len(shape) == 1 or (n == 1 and own_shape)):
                raise ValueError(
                    f"{s.path}: 'model' holds '{b.key}' as {list(shape)}, but the metadata describes {b.numel} "
                    f"elements ({', '.join(p.name for p in b.params[:3])}) sharded over {n} ranks: expected "
                    f"[{bounds.numel}] (the set has {n} shard files: is one missing, or from another save?)"
                )
            if s.padding[i] != bounds.padding:
                raise ValueError(
                    f"{s.path}: the metadata gives '{b.key}' padding {s.padding[i]}, expected {bounds.padding} for "
                    f"{b.numel} elements over {n} ranks (the shard files of a set of {n}?)"
                )
    return whole


def model_aliases(first: RankSummary, keys: Sequence[str]) -> dict[str, str]:
    """``model`` keys that neither the metadata nor the buffers name: tied parameters, the same storage as a
    backing parameter's (fairscale's unflattened units keep both names). Anything else is refused."""
    identity = {first.model[k][2]: k for k in keys}
    aliases = {}
    for key, (_, _, ident) in first.model.items():
        if key in keys or key in first.buffers:
            continue
        if ident not in identity:
            raise ValueError(
                f"{first.path}: 'model' has '{key}', which is neither a parameter in the metadata, a buffer, nor "
                "another name of a parameter"
            )
        aliases[key] = identity[ident]
    return aliases


def optimizer_ids(
    first: RankSummary,
    backings: Sequence[Backing],
    world_size: int,
    optimizer_keys: Sequence[Sequence[str]] | None,
    label: str,
) -> dict[int, int]:
    """``{flat index: optimizer id}`` for the backing parameters the optimizer holds."""
    groups = [ids for _, ids in first.groups]
    listed = {pid for ids in groups for pid in ids}
    stray = sorted(set(first.state) - listed, key=repr)
    if stray:
        raise ValueError(f"{first.path}: optimizer state for id {stray[0]!r}, which no param group lists")
    numels: dict[int, int] = {}
    for pid, entries in first.state.items():
        sizes = {math.prod(v[0]) for v in entries.values() if isinstance(v, tuple)}
        if len(sizes) > 1:
            raise ValueError(
                f"{first.path}: optimizer state of id {pid} holds tensors of different sizes {sorted(sizes)}"
            )
        if sizes:
            numels[pid] = sizes.pop()
    flat_numels = [shard_bounds(b.numel, world_size, 0).numel for b in backings]
    if optimizer_keys is None:
        return {f: pid for pid, f in match_optimizer_ids(groups, numels, flat_numels, label=label).items()}
    index = {b.key: f for f, b in enumerate(backings)}
    if [len(k) for k in optimizer_keys] != [len(g) for g in groups]:
        raise ValueError(
            f"optimizer_keys: {[len(k) for k in optimizer_keys]} keys per group, but the optimizer's groups hold "
            f"{[len(g) for g in groups]} ids ({label})"
        )
    out = {}
    for keys, ids in zip(optimizer_keys, groups):
        for key, pid in zip(keys, ids):
            if key not in index:
                raise ValueError(
                    f"optimizer_keys: '{key}' is not a parameter key of {label} (keys: {list(index)[:5]}...)"
                )
            if pid in numels and numels[pid] != flat_numels[index[key]]:
                raise ValueError(
                    f"optimizer_keys: id {pid} holds state of {numels[pid]} elements per rank, but '{key}' has "
                    f"{flat_numels[index[key]]} ({label})"
                )
            out[index[key]] = pid
    return out


def fairseq_state_entries(first: RankSummary, pid: int | None, key: str) -> tuple[StateEntry, ...]:
    if pid is None:
        return ()
    out = []
    for k, value in first.state.get(pid, {}).items():
        if isinstance(value, tuple):
            out.append(StateEntry(k, StateKind.SHARDED, dtype=dtype_to_str(value[1])))
        elif torch.is_tensor(value) or isinstance(value, (int, float)):
            out.append(StateEntry(k, StateKind.SCALAR, value=clone_value(value)))
        else:
            raise ValueError(f"{first.path}: optimizer state '{k}' of '{key}' (id {pid}) is a {type(value).__name__}")
    dtypes = {str(e.dtype) for e in out if e.kind is StateKind.SHARDED}
    if len(dtypes) > 1:
        raise ValueError(f"{first.path}: optimizer state of '{key}' (id {pid}) mixes dtypes {sorted(dtypes)}")
    return tuple(out)


def resolve_param_order(given: ParamOrder, names: Sequence[str], label: str) -> tuple[str, ...]:
    """``given`` (the unwrapped model's names in order; ``None``: the files' own order) checked against ``names``.

    A module or a path is resolved to names by the offline layer (:func:`fsdp_optim.offline.layouts.param_names`)."""
    if given is None:
        return tuple(names)
    if isinstance(given, (str, bytes)) or not all(isinstance(n, str) for n in given):
        raise TypeError(f"param_order: expected a sequence of parameter names, found {type(given).__name__}")
    order = list(given)
    missing = [n for n in names if n not in set(order)]
    extra = [n for n in order if n not in set(names)]
    if missing or extra:
        raise ValueError(
            f"param_order: must name each parameter of {label} once; missing {missing[:3]}, unknown {extra[:3]}"
        )
    return tuple(order)
