"""Sharded optimizer checkpoints inside a training job: save, load (with resharding), scatter a full dict.

Orchestration only: records in :mod:`.manifest`, files in :mod:`.storage`, re-cutting in :mod:`.recut`,
full-dict checks and cutting in :mod:`.fullstate`, collectives in :mod:`.transport`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .flatten import StateKind, classify_flat_state, clone_value
from .fullstate import GroupSpec, saved_optimizer, shard_full_state
from .layout import ModelLayout, describe
from .local import check_agreement, check_optimizer, live_groups, read_local_state
from .manifest import MANIFEST_NAME, GroupRecord, Manifest, StateEntry, dtype_to_str, wrap
from .offline import load_full_file
from .recut import RecutPlan, at_rank, plan_recut, recut_rank_state
from .storage import ShardedCheckpoint, atomic_save, new_save_id, write_manifest, write_shard_file
from .transport import broadcast_object, gather_objects, scatter_objects

__all__ = ["load_sharded_optim_state", "save_layout", "save_sharded_optim_state", "scatter_full_optim_state"]

_SAFE_LEAVES = (type(None), bool, int, float, complex, str, torch.Tensor)


def _check_root(fsdp: nn.Module) -> None:
    from fairscale.nn import FullyShardedDataParallel

    if not isinstance(fsdp, FullyShardedDataParallel):
        raise TypeError(f"fsdp: expected a fairscale FullyShardedDataParallel root, found {type(fsdp).__name__}")
    if fsdp._is_root is False:
        raise ValueError("fsdp: expected the root FSDP instance, found a nested one")


def _check_loadable(value: Any, where: str) -> None:
    """Refuse values that ``torch.load(..., weights_only=True)`` could not read back."""
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_loadable(item, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_loadable(key, where)
            _check_loadable(item, where)
    elif not isinstance(value, _SAFE_LEAVES):
        raise TypeError(
            f"{where} is a {type(value).__name__}, which torch.load(weights_only=True) cannot read back; expected "
            "numbers, strings, bools, None, tensors, or lists/tuples/dicts of them"
        )


def _own(value: Any) -> Any:
    """A CPU tensor that ``torch.save`` writes without a larger backing storage; other values as they are."""
    if not torch.is_tensor(value):
        return value
    value = value.detach()
    if value.device.type != "cpu":
        return value.cpu()
    whole = value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    return value if whole else value.clone()


def save_sharded_optim_state(fsdp: nn.Module, optim: torch.optim.Optimizer, directory: str | os.PathLike[str]) -> Path:
    """Write this rank's optimizer shard and, on rank 0, the manifest. A collective: call on every rank.

    No gather and no full buffer: every rank writes its own flat shards as they are (padding included)
    to ``directory/optim-<save id>-rank<r>-of-<W>.pt``; rank 0 then writes ``manifest.pt`` with the layout
    (units, parameter names, shapes, dtypes, padding, world size, param groups, scalar states, file
    checksums; see :mod:`fsdp_optim.manifest`). Each file is written atomically and the manifest last,
    so a crash at any point leaves the previous checkpoint in ``directory`` loadable; files of earlier
    saves are removed only after the new manifest is in place. ``directory`` must be one path that every
    rank sees (a shared file system).

    Never modifies ``optim`` or its state. Returns the manifest's path (on every rank, once it exists).

    Cost: three small object collectives (save id, per-rank summaries to rank 0, outcome) and each
    rank's own file write.
    """
    _check_root(fsdp)
    directory = Path(directory)
    layout, params = describe(fsdp)
    layout.check_world_sizes()
    local = read_local_state(layout, params, optim.state_dict(), optim.param_groups)
    for k, group in enumerate(local.groups):
        for key, value in group.hyperparams.items():
            _check_loadable(value, f"optim: hyperparameter '{key}' of param group {k}")
    for i, entries in local.state.items():
        for key, value in entries.items():
            _check_loadable(value, f"optim: state '{key}' of {layout.flat_params[i].describe()}")
    group, rank, world_size = fsdp.process_group, fsdp.rank, fsdp.world_size  # type: ignore[attr-defined]

    save_id = broadcast_object(new_save_id() if rank == 0 else None, src=0, group=group)
    failure: Exception | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        state = {i: {key: _own(v) for key, v in entries.items()} for i, entries in local.state.items()}
        report: Any = write_shard_file(directory, state, save_id=save_id, rank=rank, world_size=world_size)
    except Exception as exc:  # reported to rank 0 so that no manifest is written and every rank raises
        failure = exc
        report = f"rank {rank}: {type(exc).__name__}: {exc}"
    reports = gather_objects((local.summary, report), dst=0, group=group)

    outcome: Any = None
    if rank == 0:
        try:
            errors = [r for _, r in reports if isinstance(r, str)]  # type: ignore[union-attr]
            if errors:
                raise RuntimeError("; ".join(errors))
            if world_size > 1:
                check_agreement(layout, [summary for summary, _ in reports])  # type: ignore[union-attr]
            manifest = _manifest(layout, local.groups, local.state, optim, save_id, [r for _, r in reports])  # type: ignore[union-attr]
            write_manifest(directory, manifest)
            outcome = ("ok", "")
        except Exception as exc:
            failure = failure or exc
            outcome = ("error", f"{type(exc).__name__}: {exc}")
    outcome = broadcast_object(outcome, src=0, group=group)
    if outcome[0] != "ok":
        if failure is not None:
            raise failure
        raise RuntimeError(f"save_sharded_optim_state failed, no checkpoint was written: {outcome[1]}")
    return directory / MANIFEST_NAME


def _manifest(
    layout: ModelLayout,
    groups: Sequence[GroupSpec],
    state: Mapping[int, Mapping[str, Any]],
    optim: torch.optim.Optimizer,
    save_id: str,
    files: Sequence[Any],
) -> Manifest:
    entries: dict[int, list[StateEntry]] = {}
    for i, values in state.items():
        kinds = classify_flat_state(layout.flat_params[i], values)
        entries[i] = [
            StateEntry(key, kind, dtype=dtype_to_str(values[key].dtype))
            if kind is StateKind.SHARDED
            else StateEntry(key, kind, value=clone_value(values[key]))
            for key, kind in kinds.items()
        ]
    records = [GroupRecord(dict(g.hyperparams), g.flat_indices, g.named) for g in groups]
    return Manifest.from_layout(
        at_rank(layout, 0),
        save_id=save_id,
        optimizer=type(optim).__name__,
        state=entries,
        groups=records,
        files=files,
    )


def save_layout(fsdp: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write the model's layout (units, names, shapes, dtypes, world size; no state) to ``path``. Local.

    The file stands in for the model where a layout is needed offline: ``reshard`` of a full dict,
    ``convert`` of a fairscale-native dict, ``fsdp-optim ... --layout FILE``.
    """
    _check_root(fsdp)
    layout, _ = describe(fsdp)
    manifest = Manifest.from_layout(at_rank(layout, 0), save_id="layout")
    path = Path(path)
    atomic_save(wrap("manifest", manifest.to_dict()), path)
    return path


def _optimizer_state_dict(state: Mapping[int, Mapping[str, Any]], plan: RecutPlan) -> dict[str, Any]:
    """``{flat index: entries}`` -> ``optim.load_state_dict`` input, ids following the plan's groups."""
    out_state: dict[int, Any] = {}
    out_groups = []
    next_id = 0
    for group in plan.groups:
        ids = []
        for i in group.flat_indices:
            if i in state:
                out_state[next_id] = dict(state[i])
            ids.append(next_id)
            next_id += 1
        out_groups.append({**{k: clone_value(v) for k, v in group.hyperparams.items()}, "params": ids})
    return {"state": out_state, "param_groups": out_groups}


def load_sharded_optim_state(
    fsdp: nn.Module, optim: torch.optim.Optimizer, path: str | os.PathLike[str], *, src_rank: int = 0
) -> None:
    """Load a checkpoint into this rank's ``optim``.

    - ``path`` a sharded checkpoint directory (or its manifest): local, no collective. At the saved world
      size and layout each rank reads only its own file; otherwise (another world size, another FSDP
      nesting of the same parameters) each rank re-cuts its shard from the parts of the rank files that
      overlap it, one unit at a time.
    - ``path`` a file holding a full dict: a collective, see :func:`scatter_full_optim_state`; only
      ``src_rank`` reads the file.

    Everything is checked before the optimizer is touched: optimizer class, parameter names and shapes,
    param groups, state keys and dtypes, checksums. Errors are ``ValueError`` naming the parameter or
    file, with what was expected and what was found.
    """
    _check_root(fsdp)
    if not Path(path).is_dir() and Path(path).name != MANIFEST_NAME:
        scatter_full_optim_state(fsdp, optim, path, src_rank=src_rank)
        return
    layout, params = describe(fsdp)
    live = live_groups(optim, params)
    with ShardedCheckpoint(path) as ckpt:
        check_optimizer(ckpt.manifest.optimizer, optim, str(ckpt.directory))
        plan = plan_recut(ckpt.manifest, layout, live, source=str(ckpt.directory))
        if plan.identity:
            own = ckpt.load_rank(fsdp.rank)  # type: ignore[attr-defined]
            state = {i: own[i] for i in plan.flats}
        else:
            state = recut_rank_state(plan, layout, ckpt.copy_range, after_unit=ckpt.trim)
    optim.load_state_dict(_optimizer_state_dict(state, plan))


def scatter_full_optim_state(
    fsdp: nn.Module,
    optim: torch.optim.Optimizer,
    full: Mapping[str, Any] | str | os.PathLike[str] | None,
    *,
    src_rank: int = 0,
) -> None:
    """Load a full dict that only ``src_rank`` holds (or reads from a file) into every rank's ``optim``.

    A collective over ``fsdp``'s process group; ``full`` is ignored on other ranks (pass ``None``).
    ``src_rank`` checks the dict against the model and optimizer (as ``get_shard_from_optim_state_dict``
    does), then cuts and sends each rank its own padded shards, one rank at a time: no rank but
    ``src_rank`` ever holds more than its own shard, and ``src_rank`` holds the dict (memory-mapped when
    read from a file) plus one rank's shard. A dict the model refuses raises the same ``ValueError`` on
    every rank.

    Cost: one small broadcast, then per other rank one pickled skeleton plus one message per state tensor.
    """
    _check_root(fsdp)
    group, rank, world_size = fsdp.process_group, fsdp.rank, fsdp.world_size  # type: ignore[attr-defined]
    if not isinstance(src_rank, int) or isinstance(src_rank, bool) or not 0 <= src_rank < world_size:
        raise ValueError(f"src_rank: expected an int in [0, {world_size}), found {src_rank!r}")
    layout, params = describe(fsdp)
    live = live_groups(optim, params)
    position = {id(p): i for i, p in enumerate(fsdp.parameters())}
    positions = [position.get(id(p), len(position)) for p in params]
    trainable = [p.requires_grad for p in params]

    def cut(r: int) -> dict[str, Any]:
        return shard_full_state(
            at_rank(layout, r), full_dict, live_groups=live, param_positions=positions, trainable=trainable
        )

    full_dict: Mapping[str, Any] = {}
    own: dict[str, Any] | None = None
    failure: Exception | None = None
    status: Any = None
    if rank == src_rank:
        try:
            if full is None:
                raise ValueError(f"full: rank {src_rank} (src_rank) must pass the full dict or its file, found None")
            full_dict = full if isinstance(full, Mapping) else load_full_file(full)
            check_optimizer(saved_optimizer(full_dict), optim, "the full optimizer state dict")
            own = cut(rank)
            status = ("ok", "")
        except Exception as exc:
            failure = exc
            status = ("error", f"{type(exc).__name__}: {exc}")
    status = broadcast_object(status, src=src_rank, group=group)
    if status[0] != "ok":
        if failure is not None:
            raise failure
        kind, _, message = status[1].partition(": ")
        raise (ValueError if kind == "ValueError" else RuntimeError)(f"rank {src_rank}: {message}")
    received = scatter_objects(cut if rank == src_rank else None, own, src=src_rank, group=group)
    optim.load_state_dict(received)
