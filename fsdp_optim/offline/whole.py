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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch

from fsdp_optim.core.execute import assemble_full, restrict
from fsdp_optim.core.plan import per_parameter, plan
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.core.source import Plan
from fsdp_optim.disk.one_file import write_stream
from fsdp_optim.disk.stream_save import Pending, stream_write
from fsdp_optim.formats.safetensors_container import Tensor as ModelTensor  # one parameter, made when due
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.side_file import OWN, buffers_rule, encode_extra, read_rank_side, write_side_file
from fsdp_optim.formats.sharded.training import TrainingRecord

__all__ = [
    "WholeModel",
    "carry_side_files",
    "check_resharding",
    "check_whole_options",
    "is_whole",
    "whole_model",
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
