"""A whole checkpoint (:func:`fsdp_optim.save_checkpoint`) offline: the unwrapped model's ``state_dict()``, made one
tensor at a time, and what :func:`fsdp_optim.consolidate` returns for it.

The weights are the units' ``"@param"`` key (:meth:`~fsdp_optim.formats.sharded.reader.ShardedCheckpoint.
weights_source`), planned once against one flat per parameter at world size 1 (``core.plan.per_parameter``) and
assembled one parameter at a time (``assemble_full`` of the plan ``restrict``-ed to it), as ``to_dcp`` does. Names
are the unwrapped model's (the layout's); a tied parameter appears under every name the manifest's
``training.aliases`` gives it, all pointing to one tensor; the persistent buffers come from a side file::

    {"embed.weight": Tensor[11, 6], ..., "head.weight": <the same tensor as embed.weight>,   # params, then aliases
     "norm.weight": ..., "block1.seen": Tensor[4]}                                          # then the buffers

Which side file: rank 0's, unless the buffers were saved per rank (they differed across ranks), which is refused
unless a rank is chosen; ``extra`` is the chosen rank's (default 0). Weights keep the saved dtype (the fp32 master
under mixed precision). Per-rank units (MoE experts) are refused by the plan (one name, several tensors).

:class:`SideState`: a whole checkpoint keeps the model's persistent buffers and each rank's ``extra`` in side files
(:mod:`fsdp_optim.formats.sharded.side_file`), not in the rank files the optimizer state and weights come from;
this is the walk over them, one saved rank at a time (side files are small: buffers and loop state)::

    side = opened.side_state()            # None: not a whole checkpoint (sharded, or consolidate's file of one)
    side.buffer_names                     ("block1.seen", "norm.running_mean", ...)  as the manifest lists them
    side.per_rank                         False: rank 0's side file holds the buffers; True: every rank its own
    side.parts(1)                         ({"block1.seen": T[4], ...}, {"['rng']": T[5056], "['opt'][0]": T[3]}, values)

``parts(r)``'s buffers are rank 0's unless they were saved per rank; its second dict is ``extra``'s tensors keyed
by where they sit in the tree (``"['rng']"``; the root itself ``""``); its third ``extra``'s other values (its tree,
each tensor a placeholder).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch

from fsdp_optim.core.execute import assemble_full, restrict
from fsdp_optim.core.plan import per_parameter, plan
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.core.source import Plan
from fsdp_optim.disk.one_file import write_stream
from fsdp_optim.disk.stream_save import Pending, stream_write
from fsdp_optim.formats.fullstate import read_meta
from fsdp_optim.formats.safetensors_container import Tensor as ModelTensor  # one parameter, made when due
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import OWN, buffers_rule, encode_extra, read_rank_side, write_side_file
from fsdp_optim.formats.sharded.training import TrainingRecord
from fsdp_optim.formats.whole_file import WholeFile

__all__ = [
    "BUFFER_KEY",
    "TENSOR",
    "SideState",
    "WholeModel",
    "carry_side_files",
    "check_resharding",
    "check_whole_options",
    "extra_label",
    "is_whole",
    "whole_model",
    "whole_model_of",
    "whole_state",
    "write_whole",
]

T = TypeVar("T")
Progress = Callable[[], None] | None


@dataclass(frozen=True)
class WholeModel:
    """A whole checkpoint's model, planned and checked, its parameters not read yet (see the module docstring)."""

    params: tuple[ModelTensor, ...]  # in the model's parameter order
    aliases: tuple[tuple[str, str], ...]  # (tied name, the parameter's name)
    buffers: dict[str, torch.Tensor]
    extra: Any  # the chosen rank's
    rank: int  # whose side file gave ``extra`` (and the buffers, when saved per rank)
    world_size: int  # of the checkpoint
    optimizer: str | None = None  # the optimizer's class name, None when saved with optim=None

    def entries(self, wrap: Callable[[ModelTensor], T]) -> dict[str, T | torch.Tensor]:
        """``{name: wrap(param)}`` in parameter order, then every alias (the same object as its parameter's), then
        the buffers: the shape of ``model.state_dict()`` with each parameter as ``wrap`` makes it."""
        out: dict[str, T | torch.Tensor] = {p.name: wrap(p) for p in self.params}
        out.update({alias: out[name] for alias, name in self.aliases})
        out.update(self.buffers)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped model's ``state_dict()`` in memory (each parameter read once; aliases share it)."""
        return self.entries(lambda p: p.make())  # type: ignore[return-value]

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def is_whole(ckpt: ShardedCheckpoint | None) -> bool:
    """Whether ``ckpt`` is a whole checkpoint (weights, buffers, side files), not an optimizer-only one."""
    return ckpt is not None and ckpt.manifest.training is not None


def check_whole_options(ckpt: ShardedCheckpoint | None, rank: int | None) -> None:
    """Refuse ``rank`` unless it names a saved rank of a whole checkpoint."""
    if rank is None:
        return
    if ckpt is None or ckpt.manifest.training is None:
        raise ValueError("rank: chooses whose side file (buffers, extra) of a whole checkpoint; this source has none")
    world = ckpt.manifest.world_size
    if type(rank) is not int or not 0 <= rank < world:
        raise ValueError(f"rank: {ckpt.directory} was saved by ranks 0..{world - 1}, found rank={rank!r}")


def whole_model(ckpt: ShardedCheckpoint, *, rank: int | None = None, progress: Progress = None) -> WholeModel:
    """Plan the model of the whole checkpoint ``ckpt`` and read its side file (see the module docstring).

    ``ValueError`` for an optimizer-only checkpoint, per-rank buffers without ``rank``, a ``rank`` it was not saved
    by, and anything the plan refuses; nothing proportional to the weights is read before a tensor is made."""
    check_whole_options(ckpt, rank)
    weights = ckpt.weights_source()
    training = ckpt.manifest.training
    assert training is not None, "weights_source() refuses a checkpoint without a training section"
    chosen = _side_rank(training, rank, ckpt)
    the_plan = plan(weights, per_parameter(weights, ckpt.manifest.param_order))
    params = tuple(_param(the_plan, t, ckpt.trim, progress) for t in sorted(the_plan.flats, key=_order(the_plan)))
    buffers, extra = read_rank_side(ckpt.directory, training, chosen)
    return WholeModel(
        params, training.aliases, buffers, extra, chosen, ckpt.manifest.world_size, ckpt.manifest.optimizer
    )


def _side_rank(training: TrainingRecord, rank: int | None, ckpt: ShardedCheckpoint) -> int:
    if rank is not None:
        return rank
    if training.buffers_per_rank:
        world = ckpt.manifest.world_size
        raise ValueError(
            f"rank: {ckpt.directory}: its buffers differed across its {world} ranks (each rank saved its own), so one "
            f"model state dict needs a choice: pass rank= (--rank R) with R in 0..{world - 1}"
        )
    return 0


def _order(the_plan: Plan) -> Callable[[int], int]:
    rank = {name: i for i, name in enumerate(the_plan.target.param_order)}
    return lambda t: rank[the_plan.target.flat_params[t].params[0].name]


def _param(the_plan: Plan, t: int, trim: Callable[[], None], progress: Progress) -> ModelTensor:
    flat = the_plan.target.flat_params[t]
    spec = flat.params[0]

    def make() -> torch.Tensor:
        tensor = assemble_full(restrict(the_plan, t, WEIGHTS_KEY))[t][WEIGHTS_KEY].view(spec.shape)
        trim()
        if progress is not None:
            progress()
        return tensor

    return ModelTensor(spec.name, tuple(spec.shape), flat.dtype, make)


def whole_state(
    model: WholeModel, optimizer: Mapping[str, Any] | None, wrap: Callable[[ModelTensor], Any] | None = None
) -> dict[str, Any]:
    """``{"model": state dict, "optimizer": full dict or None, "extra": ...}``: what consolidate gives for a whole
    checkpoint (``wrap``: how each parameter appears; default: read now)."""
    entries = model.state_dict() if wrap is None else model.entries(wrap)
    return {"model": entries, "optimizer": None if optimizer is None else dict(optimizer), "extra": model.extra}


def write_whole(
    model: WholeModel,
    optimizer: Mapping[str, Any] | None,
    out: str | os.PathLike[str],
    *,
    inputs: Sequence[Any],
    overwrite: bool = True,
) -> int:
    """:func:`whole_state` written as one ``torch.save`` file ``out`` (locked, journaled, atomic), each parameter
    made only when its bytes are written and freed before the next: memory is one parameter plus the optimizer's
    full dict and the buffers. Returns the file's size; an existing ``out`` is refused unless ``overwrite``."""
    obj = whole_state(model, optimizer, lambda p: Pending(p.shape, p.dtype, p.make))

    def write(f: BinaryIO) -> None:
        stream_write(obj, f, where=str(out))

    return write_stream(write, out, inputs=inputs, purpose="fsdp_optim.consolidate", overwrite=overwrite)


def whole_model_of(whole: WholeFile, *, rank: int = 0) -> WholeModel:
    """A consolidated file's model as a whole checkpoint's, so that the verbs that take one (convert, consolidate to
    safetensors) take it: each parameter a copy made when asked, its tied names and buffers as the file holds them,
    ``extra`` of saved rank ``rank`` (the one the file kept)."""
    params = tuple(
        ModelTensor(name, tuple(whole.model[name].shape), whole.model[name].dtype, whole.model[name].clone)
        for name in whole.params
    )
    meta = read_meta(whole.optimizer, f"{whole.label}['optimizer']") if whole.optimizer is not None else None
    optimizer = None if whole.optimizer is None else (meta or {}).get("optimizer") or "unknown"
    return WholeModel(params, whole.aliases, whole.buffer_tensors(), whole.extra, rank, 1, optimizer)


def check_resharding(ckpt: ShardedCheckpoint, world_size: int, buffers: str = "refuse") -> str:
    """The rule that finds the buffers of ``ckpt`` resharded to ``world_size``
    (:func:`~fsdp_optim.formats.sharded.side_file.buffers_rule`): buffers saved per rank go to another world size
    only with a choice (``"rank0"``, ``"mean"``), as in :func:`fsdp_optim.load_checkpoint`; ``ValueError`` naming
    the option without one."""
    training = ckpt.manifest.training
    if training is None:
        return OWN
    return buffers_rule(training, ckpt.manifest.world_size, world_size, buffers, str(ckpt.directory))


def carry_side_files(ckpt: ShardedCheckpoint, staging: Path, manifest: Manifest, buffers: str = "refuse") -> Manifest:
    """Write the side files of ``manifest`` (the re-cut checkpoint, ``W'`` ranks) into ``staging`` and return it with
    its training section: new rank ``r`` gets saved rank ``r % W``'s ``extra`` (the rule of ``load_checkpoint``),
    rank 0 the shared buffers; buffers saved per rank stay per rank at ``W' == W``, and at another world size
    become shared ones, chosen by ``buffers`` (saved rank 0's or their mean: :func:`check_resharding`)."""
    training = ckpt.manifest.training
    assert training is not None, "a whole checkpoint has a training section"
    rule = check_resharding(ckpt, manifest.world_size, buffers)
    per_rank = training.buffers_per_rank and rule == OWN
    files = []
    for rank in range(manifest.world_size):
        found, extra = read_rank_side(ckpt.directory, training, rank % ckpt.manifest.world_size, rule=rule)
        kept = found if per_rank or rank == 0 else {}
        files.append(
            write_side_file(
                staging, save_id=manifest.save_id, rank=rank, world_size=manifest.world_size, buffers=kept,
                extra=encode_extra(extra),
            )
        )
    return replace(manifest, training=replace(training, buffers_per_rank=per_rank, files=tuple(files)))


BUFFER_KEY = "@buffer"  # the key of a buffer's row or finding, beside the weights' "@param"


def extra_label(rank: int) -> str:
    """What a row or finding of saved rank ``rank``'s ``extra`` is named, in place of a parameter's name."""
    return f"extra of rank {rank}"


@dataclass(frozen=True)
class SideState:
    """The buffers and ``extra`` of one whole checkpoint, sharded or consolidated (see the module docstring)."""

    world_size: int  # saved ranks with a side file (1 for consolidate's file: it keeps one rank's extra)
    per_rank: bool  # every rank saved its own buffers (they differed across ranks)
    buffer_names: tuple[str, ...]
    read: Callable[[int], tuple[dict[str, torch.Tensor], Any]]  # saved rank -> (buffers, extra), checked
    holds_extra: bool = True  # False: a layout that keeps no extra at all (Hugging Face's), not an extra of None

    @classmethod
    def of_checkpoint(cls, ckpt: ShardedCheckpoint) -> SideState:
        """The side files of the whole sharded checkpoint ``ckpt``; ``ValueError`` for an optimizer-only one."""
        training = ckpt.manifest.training
        if training is None:
            raise ValueError(f"{ckpt.directory}: an optimizer-only checkpoint has no side files (not a whole one)")
        names = tuple(b.name for b in training.buffers)
        return cls(ckpt.manifest.world_size, training.buffers_per_rank, names,
                   partial(read_rank_side, ckpt.directory, training))  # fmt: skip

    @classmethod
    def of_whole_file(cls, whole: WholeFile) -> SideState:
        """The buffers and ``extra`` of consolidate's file of a whole checkpoint, as saved rank 0's."""
        buffers = whole.buffer_tensors()
        return cls(1, False, tuple(buffers), lambda _: (buffers, whole.extra))

    def parts(self, saved_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
        """``(buffers, extra's tensors by place, extra's other values)`` of saved rank ``saved_rank`` (checked against
        the manifest); the values: ``extra``'s tree with each tensor replaced by :data:`TENSOR` (so that two extras'
        numbers, strings and structure compare apart from their tensors)."""
        buffers, extra = self.read(saved_rank)
        return buffers, dict(_tensors(extra, "")), _values(extra)


TENSOR = "<tensor>"  # where a tensor of extra sits, in :meth:`SideState.parts`' values


def _values(value: Any) -> Any:
    if torch.is_tensor(value):
        return TENSOR
    if isinstance(value, dict):
        return {k: _values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_values(v) for v in value)
    return value


def _tensors(value: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``extra``'s tree (its depth is bounded by the side file's reader), keyed by its place."""
    if torch.is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{where}[{i}]")
