"""Offline work on checkpoints: no process group, no model.

- :func:`consolidate`: a sharded checkpoint directory -> the full dict, exactly what
  ``gather_full_optim_state_dict`` returns for the same optimizer state (same keys, ids, order, dtypes
  and bits), built with :func:`~fsdp_optim.fullstate.build_full_state`.
- :func:`reshard`: a sharded directory or a full file -> a sharded directory for ``world_size`` ranks
  that a job of that size loads with no communication (each rank reads its own file).

Memory: rank files are memory-mapped and read one FSDP unit at a time; mappings are dropped whenever
the touched pages exceed ``max_mapped_bytes``. ``consolidate`` therefore peaks near the size of the
full dict it returns plus that bound; ``reshard`` writes one output rank at a time and peaks near one
output shard plus that bound.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from .flatten import StateKind, assemble, classify_flat_state
from .fullstate import GroupSpec, build_full_state, read_header, saved_optimizer, shard_full_state
from .layout import ModelLayout, describe
from .manifest import MANIFEST_NAME, GroupRecord, Manifest, StateEntry, dtype_to_str
from .recut import at_rank, plan_recut, recut_rank_state
from .storage import (
    DEFAULT_MAPPED_BYTES,
    ShardedCheckpoint,
    checkpoint_dir,
    is_sharded_checkpoint,
    load_file,
    new_save_id,
    read_manifest,
    write_manifest,
    write_shard_file,
)

__all__ = ["consolidate", "load_full_file", "progress_bar", "reshard", "resolve_layout"]

T = TypeVar("T")
LayoutLike = ModelLayout | Manifest | nn.Module | str | os.PathLike


def progress_bar(items: Iterable[T], *, enabled: bool, total: int | None = None, desc: str = "") -> Iterator[T]:
    """``tqdm`` over ``items`` when ``enabled`` and stderr is a terminal; the plain iterable otherwise."""
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="unit", disable=None, leave=False)


def resolve_layout(layout: LayoutLike) -> ModelLayout:
    """A :class:`ModelLayout` from a layout, a manifest, a fairscale-FSDP-wrapped root module, or a path
    to a sharded checkpoint directory, its manifest, or a file written by ``save_layout``."""
    if isinstance(layout, ModelLayout):
        return layout
    if isinstance(layout, Manifest):
        return layout.layout(0)
    if isinstance(layout, nn.Module):
        return at_rank(describe(layout)[0], 0)
    if isinstance(layout, (str, os.PathLike)):
        return read_manifest(layout).layout(0)
    raise TypeError(
        f"layout: expected a ModelLayout, Manifest, FSDP root module or path, found {type(layout).__name__}"
    )


def load_full_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A full dict from a file, memory-mapped (``weights_only=True``); ``ValueError`` if it is something else."""
    full = load_file(path, mmap=True)
    if not isinstance(full, Mapping) or not {"state", "param_groups", "param_names"} <= set(full):
        found = sorted(map(str, full)) if isinstance(full, Mapping) else type(full).__name__
        hint = " (a fairscale-native dict: convert it first)" if isinstance(full, Mapping) and "param_id_map" in full else ""
        raise ValueError(
            f"{path}: expected a full optimizer state dict with 'state', 'param_groups' and 'param_names', "
            f"found {found}{hint}"
        )
    return dict(full)


def consolidate(
    path: str | os.PathLike[str], *, progress: bool = False, max_mapped_bytes: int = DEFAULT_MAPPED_BYTES
) -> dict[str, Any]:
    """The full dict of a sharded checkpoint, without a process group or the model.

    ``path`` is the checkpoint directory (or its manifest). Every rank file's header and every unit's
    checksum are verified as they are read. Returns the dict that ``gather_full_optim_state_dict``
    returned at save time (``{"state", "param_groups", "param_names", "fsdp_optim"}``, all tensors new
    CPU memory), bit for bit.
    """
    with ShardedCheckpoint(path, max_mapped_bytes=max_mapped_bytes) as ckpt:
        manifest = ckpt.manifest
        layout = manifest.layout(0)
        flat_states: dict[int, dict[str, Any]] = {}
        units = [i for i, f in enumerate(manifest.flat_params) if f.state]
        for i in progress_bar(units, enabled=progress, desc="consolidate"):
            flat = layout.flat_params[i]
            values: dict[str, Any] = {}
            for entry in manifest.flat_params[i].state:
                if entry.kind is StateKind.SHARDED:
                    values[entry.key] = assemble(flat, [ckpt.unit(r, i)[entry.key] for r in range(flat.world_size)])
                else:
                    values[entry.key] = entry.value
            flat_states[i] = values
            ckpt.trim()
    groups = [GroupSpec(g.hyperparams, g.flat_indices, g.named) for g in manifest.groups]
    return build_full_state(layout, groups, flat_states, optimizer=manifest.optimizer)  # type: ignore[arg-type]


def reshard(
    source: str | os.PathLike[str] | Mapping[str, Any],
    world_size: int,
    out_dir: str | os.PathLike[str],
    *,
    layout: LayoutLike | None = None,
    progress: bool = False,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
) -> Path:
    """Write ``source`` as a sharded checkpoint for ``world_size`` ranks into ``out_dir``; returns its manifest.

    Args:
        source: a sharded checkpoint directory (any world size), or a full dict / a file holding one.
        world_size: ranks of the job that will load it; units that were not sharded stay whole.
        out_dir: created if needed; must not be the source directory. An existing checkpoint there
            is replaced atomically (the manifest is written last).
        layout: required for a full source, which does not say how parameters are grouped into FSDP
            units: a sharded checkpoint or layout file of the same model (any world size), its
            :class:`Manifest`, a :class:`ModelLayout`, or the FSDP-wrapped model.
        progress: show a progress bar (on a terminal).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, found {world_size!r}")
    out = Path(out_dir)
    if isinstance(source, (str, os.PathLike)) and is_sharded_checkpoint(source):
        if out.exists() and out.resolve() == checkpoint_dir(source).resolve():
            raise ValueError(f"out_dir: {out} is the source checkpoint's directory; write to another directory")
        if layout is not None:
            raise ValueError("layout: a sharded source carries its own layout; pass layout only with a full dict")
        return _write_all_or_nothing(
            out,
            lambda staging: _reshard_sharded(
                source, world_size, staging, progress=progress, max_mapped_bytes=max_mapped_bytes
            ),
        )
    if not isinstance(source, Mapping):
        check_source_path(source)
    if layout is None:
        raise ValueError(
            f"layout: resharding a full dict ({source if not isinstance(source, Mapping) else 'dict'}) needs the "
            "model's layout: a sharded checkpoint or layout file of the same model, or the FSDP model"
        )
    full = source if isinstance(source, Mapping) else load_full_file(source)
    model_layout = resolve_layout(layout)
    return _write_all_or_nothing(
        out, lambda staging: _reshard_full(full, model_layout, world_size, staging, progress=progress)
    )


def check_source_path(source: str | os.PathLike[str]) -> None:
    """Refuse a path that is neither a sharded checkpoint nor a file, saying which it is."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        raise ValueError(
            f"{path}: not a sharded checkpoint (no {MANIFEST_NAME} in this directory) and not a full dict file"
        )


def _write_all_or_nothing(out: Path, write: Callable[[Path], Manifest]) -> Path:
    """Have ``write`` put every rank file into a staging directory beside ``out`` and return the manifest;
    only then move the files into ``out`` and commit the manifest there (last). A refused source thus
    leaves ``out`` exactly as it was, or absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.reshard-", dir=out.parent))
    try:
        manifest = write(staging)
        out.mkdir(exist_ok=True)
        for entry in staging.iterdir():
            os.replace(entry, out / entry.name)
        return write_manifest(out, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _reshard_sharded(
    source: str | os.PathLike[str], world_size: int, out: Path, *, progress: bool, max_mapped_bytes: int
) -> Manifest:
    """Write the rank files for ``world_size`` into ``out``; return their manifest (not yet written)."""
    with ShardedCheckpoint(source, max_mapped_bytes=max_mapped_bytes) as ckpt:
        target = ckpt.manifest.with_world_size(world_size)
        target = replace(target, save_id=new_save_id())
        layout = target.layout(0)
        plan = plan_recut(ckpt.manifest, layout, None, source=str(ckpt.directory))
        records = []
        steps = progress_bar(range(world_size), enabled=progress, desc=f"reshard -> {world_size} ranks")
        for rank in steps:
            state = recut_rank_state(plan, at_rank(layout, rank), ckpt.copy_range, after_unit=ckpt.trim)
            records.append(write_shard_file(out, state, save_id=target.save_id, rank=rank, world_size=world_size))
            del state
    return replace(target, groups=plan.groups, files=tuple(records))


def _full_groups(layout: ModelLayout, full: Mapping[str, Any]) -> list[list[int]]:
    """Flat indices per param group of ``full``, by the group of each flat parameter's first named parameter."""
    names, group_of = read_header(full)
    id_of = {name: pid for pid, name in names.items()}
    members: list[list[int]] = [[] for _ in full["param_groups"]]
    for i, flat in enumerate(layout.flat_params):
        for spec in flat.params:
            pid = id_of.get(spec.name)
            if pid in group_of:
                members[group_of[pid]].append(i)
                break
    return members


def _reshard_full(full: Mapping[str, Any], layout: ModelLayout, world_size: int, out: Path, *, progress: bool) -> Manifest:
    """Write the rank files for ``world_size`` into ``out``; return their manifest (not yet written)."""
    target = Manifest.from_layout(layout, save_id=new_save_id()).with_world_size(world_size)
    layout = target.layout(0)
    members = _full_groups(layout, full)
    order = [i for group in members for i in group]  # optimizer id -> flat index
    n = len(layout.flat_params)
    entries: dict[int, list[StateEntry]] = {}
    records = []
    for rank in progress_bar(range(world_size), enabled=progress, desc=f"reshard -> {world_size} ranks"):
        ranked = at_rank(layout, rank)
        local = shard_full_state(ranked, full, live_groups=members, param_positions=range(n), trainable=[False] * n)
        state = {order[pid]: values for pid, values in local["state"].items()}
        if rank == 0:
            for i, values in state.items():
                kinds = classify_flat_state(ranked.flat_params[i], values)
                entries[i] = [
                    StateEntry(key, kind, dtype=dtype_to_str(values[key].dtype))
                    if kind is StateKind.SHARDED
                    else StateEntry(key, kind, value=values[key])
                    for key, kind in kinds.items()
                ]
        records.append(write_shard_file(out, state, save_id=target.save_id, rank=rank, world_size=world_size))
        del local, state
    groups = [
        GroupRecord(
            {k: v for k, v in g.items() if k not in ("params", "param_names")}, tuple(m), "param_names" in g
        )
        for g, m in zip(full["param_groups"], members, strict=True)
    ]
    optimizer = saved_optimizer(full)
    return Manifest.from_layout(
        layout, save_id=target.save_id, optimizer=optimizer, state=entries, groups=groups, files=records
    )
