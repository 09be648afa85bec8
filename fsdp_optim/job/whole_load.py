"""Loading a whole checkpoint into a live model (and optimizer): all or nothing, on every rank, at any world size
(:func:`load_checkpoint`): :func:`plan_load`, :func:`stage_load` into new memory, agree, :func:`commit_load`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.data_position import DataPosition
from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.core.execute import cut_rank, optimizer_state_dict, saved_ranks
from fsdp_optim.core.flatten import clone_value
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.core.source import Plan, Source
from fsdp_optim.disk.location import Location, as_local_file, exists
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.untrusted import load_file
from fsdp_optim.formats.named_safetensors.reader import is_named_safetensors
from fsdp_optim.formats.sharded.byte_ranges import load_spans
from fsdp_optim.formats.sharded.locate import source_kind
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import OWN, Received, buffers_rule, read_rank_side
from fsdp_optim.formats.sharded.training import BufferSpec, TrainingRecord
from fsdp_optim.formats.whole_file import TIED_KEY, WholeFile, is_whole_file, read_whole_safetensors
from fsdp_optim.job.agreed import step
from fsdp_optim.job.local import check_optimizer
from fsdp_optim.job.model_state import live_shaped, persistent_buffers, weight_shards
from fsdp_optim.job.ring_load import (
    Verified,
    into_live,
    live_destination,
    optimizer_state_on_device,
    read_own,
    verify_own,
)
from fsdp_optim.job.root import Root, verify_root
from fsdp_optim.job.sampler import resume_data
from fsdp_optim.job.staging import before_change

__all__ = ["LOAD_WINDOW_BYTES", "LoadPlans", "commit_load", "load_checkpoint", "plan_load", "stage_load"]

LOAD_WINDOW_BYTES = 32 << 20  # file pages a re-cutting load keeps mapped before it drops them


@dataclass(frozen=True)
class Staged:
    """Everything one rank will change, read and checked into memory of its own."""

    weights: dict[int, torch.Tensor]  # {flat index: padded shard}
    buffers: dict[str, torch.Tensor]
    optim_state: dict[str, Any] | None  # for optim.load_state_dict
    extra: Any
    data: DataPosition | None = None  # the data stream's position, when saved with data=
    own: Verified | None = None  # at the saved layout through a ring: verified, read into the live state at commit
    plans: LoadPlans | None = None  # (with ``own``: how its entries are split)


def load_checkpoint(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    path: str | os.PathLike[str] | Location,
    *,
    buffers: str = "refuse",
    data: object = None,
) -> Any:
    """Load a whole checkpoint (:func:`fsdp_optim.save_checkpoint`) into ``model`` and ``optim``; return ``extra``.

    A collective: call on every rank. Works at the saved world size (each rank reads its own files) and at any
    other world size and FSDP nesting of the same model (each rank re-cuts its shards from the byte ranges of
    the rank files that overlap them, one unit at a time): no rank holds more than its own shards plus a bounded
    read buffer, and no rank materializes the full model. ``optim=None`` loads the model alone.

    All or nothing: every rank first reads and checks what it will change (parameter names, shapes and dtypes,
    buffers, optimizer class, param groups and state, checksums of every byte it reads), the ranks agree, and
    only then is anything changed; a failure on any rank raises the same ``ValueError`` on every rank, with no
    parameter, buffer or optimizer changed anywhere.

    ``path`` may also be the file :func:`fsdp_optim.consolidate` writes of a whole checkpoint (``{"model",
    "optimizer", "extra"}``): every rank reads it and cuts its own shards; every rank gets its ``extra``.

    ``extra``: at the saved world size, rank r gets what rank r saved; at another, rank r gets saved rank
    ``r % saved_world_size``'s (so ranks beyond the saved count share a copy: reseed per-rank RNG from it, e.g.
    ``torch.manual_seed(base_seed + rank)``, when the world size changed).

    ``buffers``: what every rank gets at another world size when the buffers were saved per rank (they differed
    across ranks at save time, as BatchNorm's running statistics over each rank's data do): ``"refuse"`` (the
    default: a ``ValueError`` naming this option), ``"rank0"`` (saved rank 0's, every buffer), ``"mean"`` (each
    floating-point buffer's mean across the saved ranks, summed in float64 and cast back to its dtype; integer and
    bool buffers, such as ``num_batches_tracked``, are rank 0's). At the saved world size each rank loads its own,
    and buffers saved once (equal across ranks) load as saved, whatever the choice.

    ``data``: a :class:`~fsdp_optim.ResumableSampler` to put at the checkpoint's data position (saved with
    ``data=``), at any world size: each rank starts at its share of the next global batch. A checkpoint without
    one, or a position the sampler refuses (another dataset, another global batch: see its ``load_state_dict``),
    is refused like any other mismatch, with nothing changed on any rank.

    Parameters load only into their saved dtype; a floating-point buffer loads into another floating-point dtype
    with a cast (mixed precision keeps buffers in the compute dtype once the model has run a forward pass, in fp32
    before).
    """
    root = verify_root(model, optim)
    with step(f"load_checkpoint({str(path)!r}) changed nothing on any rank", group=root.group):
        staged = _stage(root, model, optim, where(path), buffers)
        then = resume_data(data, staged.data, str(path))  # checked here; the sampler moves after the commit
    commit_load(root, model, optim, staged)
    then()
    return staged.extra


@dataclass(frozen=True)
class LoadPlans:
    """A load's plans, made once: the model weights' and (with an optimizer) its state's."""

    weights: Plan
    optim: Plan | None
    buffers: str = OWN  # how the buffers are found: side_file.buffers_rule


def plan_load(
    root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, ckpt: ShardedCheckpoint, buffers: str = "refuse"
) -> LoadPlans:
    """Check the checkpoint against the live model and optimizer and plan what every rank reads; reads only the
    manifest."""
    saved = ckpt.manifest
    optim_source = lambda: ckpt.source() if saved.optimizer is not None else None  # noqa: E731
    return _plans(root, model, optim, ckpt.weights_source, optim_source, saved.training, saved.world_size,
                  str(ckpt.directory), buffers)  # fmt: skip


def _plans(
    root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, weights: Callable[[], Source],
    saved: Callable[[], Source | None], training: TrainingRecord | None, saved_world: int, where: str, buffers: str,
) -> LoadPlans:  # fmt: skip
    """The plans of a load of ``weights()`` and, with ``optim``, ``saved()`` (None: the model saved alone)."""
    weight_shards(root)  # refuses parameters that are not in their sharded state, before anything is read
    weights_plan = plan(weights(), root.layout, members=[list(range(len(root.layout.flat_params)))])
    assert training is not None, "weights_source() refuses a checkpoint without a training section"
    optim_plan, source = None, saved() if optim is not None else None
    if optim is not None and source is None:
        raise ValueError(f"optim: {where} holds the model alone (saved with optim=None); load it with optim=None and "
                         "start the optimizer afresh")  # fmt: skip
    if optim is not None and source is not None:
        check_optimizer(source.optimizer, optim, where)
        optim_plan = plan(source, root.layout, members=root.members)
    rule = _check_buffers(training, persistent_buffers(model), saved_world, root.world_size, where, buffers)
    return LoadPlans(weights_plan, optim_plan, rule)


def _cut(
    plans: LoadPlans, rank: int, trim: Callable[[], None] | None = None
) -> tuple[dict[int, torch.Tensor], dict[str, Any] | None]:
    """This rank's weight shards and optimizer state (as ``optim.load_state_dict`` takes it), cut from the plans."""
    weights = {i: e[WEIGHTS_KEY] for i, e in cut_rank(plans.weights, rank, after_unit=trim).items()}
    if plans.optim is None:
        return weights, None
    return weights, optimizer_state_dict(plans.optim, cut_rank(plans.optim, rank, after_unit=trim))


def stage_load(
    root: Root, ckpt: ShardedCheckpoint, plans: LoadPlans, sides: Received | None = None, *, in_place: bool = False
) -> Staged:
    """Read and check into new memory everything this rank will change (``sides``: side files held in memory); with
    ``in_place`` at the saved layout through a GPU's ring, only checked (:func:`~fsdp_optim.job.ring_load.verify_own`),
    read into the live state at the commit."""
    rank, training = root.rank, ckpt.manifest.training
    assert training is not None, "weights_source() refuses a checkpoint without a training section"
    verified = None
    if plans.weights.identity:
        kept = plans.optim.flats if plans.optim is not None else {}
        want = lambda i, key: i in plans.weights.flats if key == WEIGHTS_KEY else i in kept  # noqa: E731
        devices = [p.device for p in root.params]
        verified = verify_own(ckpt, rank, devices, want) if in_place else None
        own = {} if verified is not None else read_own(ckpt, rank, devices, want)  # on a GPU: through its ring
        weights, optim_state = _split_own(own, plans) if verified is None else ({}, None)
    else:
        ckpt.open_ranks(saved_ranks(plans.weights, rank) or [0])
        weights, optim_state = _cut(plans, rank, ckpt.trim)
    buffers, extra = read_rank_side(
        ckpt.directory, training, rank % ckpt.manifest.world_size, sides, rule=plans.buffers
    )
    return Staged(weights, buffers, optim_state, extra, training.data, verified, plans)


def _split_own(
    own: Mapping[int, Mapping[str, Any]], plans: LoadPlans
) -> tuple[dict[int, torch.Tensor], dict[str, Any] | None]:
    """A rank file's entries (:func:`~fsdp_optim.job.ring_load.read_own`) as the weights and the optimizer state."""
    kept = plans.optim.flats if plans.optim is not None else {}
    weights = {i: own[i][WEIGHTS_KEY] for i in plans.weights.flats}
    state = {i: {k: v for k, v in own[i].items() if k != WEIGHTS_KEY} for i in kept}
    return weights, optimizer_state_dict(plans.optim, state) if plans.optim is not None else None


def _stage(
    root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, path: Location, buffers: str
) -> Staged:
    if is_whole_file_path(path):
        with as_local_file(path) as file:  # (a local file read in place; elsewhere fetched whole)
            return stage_file(root, model, optim, file)
    # A re-cut reads each unit through mappings dropped past the window (the last unit may overshoot it): the
    # window plus one unit stays within the rank's own shards + 64 MiB for units up to 32 MiB.
    with ShardedCheckpoint(path, max_mapped_bytes=LOAD_WINDOW_BYTES, lazy=True) as ckpt:
        plans = plan_load(root, model, optim, ckpt, buffers)
        if plans.weights.identity or ckpt.manifest.version < 3:  # its own files, whole: nothing to cut from ranges
            return stage_load(root, ckpt, plans, in_place=True)
        spans = lambda: load_spans(ckpt, plans.weights, plans.optim, root.rank, buffers=plans.buffers)  # noqa: E731
        with ckpt.fetched_ahead(spans) as sides:
            return stage_load(root, ckpt, plans, sides)


def is_whole_file_path(path: Location) -> bool:
    """Whether ``path`` is consolidate's file of a whole checkpoint, not a checkpoint's directory, prefix or
    manifest (nothing there: opening it as a checkpoint says so)."""
    if exists(path):
        return False
    try:
        return source_kind(path) == "file"
    except (FileNotFoundError, ValueError):
        return False


def stage_file(
    root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, path: str | os.PathLike[str]
) -> Staged:
    """:func:`stage_load` of consolidate's file of a whole checkpoint: every rank reads it and cuts its own shards."""
    where_ = str(path)
    if is_named_safetensors(path):  # consolidate's one safetensors file: the same content as its .pt
        obj = read_whole_safetensors(path)
    else:
        obj = load_file(path, mmap=True, disjoint=True, tied=TIED_KEY)
    if not is_whole_file(obj):
        found = f"a dict with keys {sorted(map(str, obj))[:6]}" if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(
            f"{where_}: expected a whole checkpoint (save_checkpoint's directory, or the file consolidate writes of "
            f"one: {{'model', 'optimizer', 'extra'}}), found {found}"
        )
    whole = WholeFile.of(obj, where_, params=root.layout.param_order)
    buffers = whole.buffer_tensors()
    specs = tuple(BufferSpec(n, tuple(t.shape), dtype_to_str(t.dtype)) for n, t in buffers.items())
    training = TrainingRecord(specs, False, whole.aliases, ())  # its buffers: one set, as saved
    plans = _plans(root, model, optim, whole.weights_source, whole.source, training, root.world_size, where_, "refuse")
    weights, optim_state = _cut(plans, root.rank)
    return Staged(weights, {n: t.clone() for n, t in buffers.items()}, optim_state, clone_value(whole.extra))


def _check_buffers(
    training: TrainingRecord, live: Mapping[str, torch.Tensor], saved_world: int, world: int, where: str, choice: str
) -> str:
    """Refuse a checkpoint whose buffers are not the model's (names, shapes, dtypes), or per-rank buffers at another
    W without a choice; else the rule that finds them (:func:`~fsdp_optim.formats.sharded.side_file.buffers_rule`)."""
    saved = training.buffer_specs()
    errors = [f"buffer '{n}' of the model is missing from {where}" for n in live if n not in saved]
    errors += [f"{where} has buffer '{n}', which the model does not have" for n in saved if n not in live]
    for name in (n for n in saved if n in live):
        spec, buffer = saved[name], live[name]
        if spec.shape != tuple(buffer.shape) or not _castable(spec.dtype, buffer.dtype):
            errors.append(
                f"buffer '{name}' is {spec.dtype}{list(spec.shape)} in {where}, expected "
                f"{dtype_to_str(buffer.dtype)}{list(buffer.shape)} as in the model"
            )
    rule = OWN
    try:
        rule = buffers_rule(training, saved_world, world, choice, where)
    except ValueError as exc:
        errors.append(str(exc))
    if errors:
        raise ValueError("; ".join(errors[:5]) + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""))
    return rule


def _castable(saved: str, live: torch.dtype) -> bool:
    """A buffer loads into one of its own dtype or, floating point into floating point, with a cast: fairscale's
    mixed precision keeps buffers in the compute dtype after the first forward and in fp32 before it."""
    found = dtype_from_str(saved, where="buffer")
    return found == live or (found.is_floating_point and live.is_floating_point)


def commit_load(root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, staged: Staged) -> None:
    """Copy what was staged into the live model and optimizer, once every rank's checks passed
    (:mod:`fsdp_optim.job.ring_load`)."""
    before_change(model)  # an async save still copying these weights and state comes first (optim=None too)
    before_change(optim)
    if staged.own is not None:  # verified through the ring: now read again, straight into the live tensors
        assert staged.plans is not None, "a verified load keeps its plans"
        weights, optim_state = _split_own(staged.own.land(live_destination(root.params, optim)), staged.plans)
        staged = replace(staged, weights=weights, optim_state=optim_state, own=None)
    live_buffers = persistent_buffers(model)
    pairs = [(param.data, live_shaped(root, i, staged.weights[i])) for i, param in enumerate(root.params)]
    into_live(pairs + [(live_buffers[name], value) for name, value in staged.buffers.items()])
    if optim is not None and staged.optim_state is not None:
        optim.load_state_dict(optimizer_state_on_device(optim, staged.optim_state))
