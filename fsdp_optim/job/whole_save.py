"""Saving the whole training state in one sharded checkpoint: weights, buffers, optimizer state and ``extra``.

Orchestration only: every rank's weight shards go into its rank file beside its optimizer state (one more state
key per unit, :data:`~fsdp_optim.core.records.WEIGHTS_KEY`), its ``extra`` and (rank 0, or every rank when they
differ) the buffers into its side file (:mod:`fsdp_optim.formats.sharded.side_file`), and rank 0 commits one
manifest last (:func:`fsdp_optim.job.save_commit.commit_save`): the checkpoint exists whole or not at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fsdp_optim.core.data_position import DataPosition
from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.disk.location import Location, ObjectPath
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.side_file import encode_extra, host_copy, write_side_file
from fsdp_optim.formats.sharded.training import BufferSpec, TrainingRecord
from fsdp_optim.job.agreed import step
from fsdp_optim.job.async_save import (
    MEET_S,
    AsyncSave,
    checkpoint_group,
    finish_previous,
    keep_liveness_group,
    launch,
    liveness_group,
)
from fsdp_optim.job.interrupts import interrupts_deferred
from fsdp_optim.job.local import LocalState
from fsdp_optim.job.model_state import buffers_digest, persistent_buffers, weight_shards
from fsdp_optim.job.root import Root, read_aliases, verify_root
from fsdp_optim.job.sampler import agreed_position, data_position
from fsdp_optim.job.save_commit import (
    Side,
    check_in_seconds,
    commit_save,
    own_tensor,
    read_for_save,
    start_save,
)
from fsdp_optim.job.stager import pieces
from fsdp_optim.job.transport import ProcessGroup, all_gather_objects, check_in

__all__ = ["async_save_checkpoint", "prepare_whole", "save_checkpoint"]


@dataclass(frozen=True)
class _Prepared:
    """One rank's part of a whole checkpoint, checked and ready to write (tensors not copied)."""

    local: LocalState
    state: dict[int, dict[str, Any]]  # {flat: {optimizer key or WEIGHTS_KEY: padded shard or scalar}}
    buffers: dict[str, torch.Tensor]
    extra: tuple[str, dict[str, torch.Tensor]]  # encode_extra's (JSON text, tensors)
    aliases: tuple[tuple[str, str], ...]
    data: DataPosition | None = None  # the data stream's position (data=), the same on every rank


def save_checkpoint(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    path: str | os.PathLike[str] | Location,
    *,
    extra: object = None,
    overwrite: bool = False,
    data: object = None,
) -> Path | ObjectPath:
    """Save the whole training state into the checkpoint directory ``path``. A collective: call on every rank.

    Every rank writes its own flat parameter shards (the fp32 master shard under mixed precision) together with
    its optimizer state into its rank file, and its ``extra`` into its side file; the model's persistent
    buffers go once into rank 0's side file, or into every rank's when they differ across ranks (one digest
    per rank, compared in one small all-gather). Rank 0 commits the manifest last: a crash at any point leaves
    the previous checkpoint in ``path`` as it was. No rank gathers or copies the full model.

    ``optim=None`` saves the model alone. ``extra`` is what the training loop needs back, per rank: any tree of
    dicts (``str`` keys), lists, tuples, numbers, strings, bools, None and tensors (step counters, an LR
    scheduler's or grad scaler's ``state_dict()``, ``torch.get_rng_state()``, a data-loader position).
    :func:`fsdp_optim.load_checkpoint` gives it back exactly (at another world size, rank r gets saved rank
    ``r % saved_world_size``'s). ``data``: the job's place in its data stream, once for the whole job (a
    :class:`~fsdp_optim.ResumableSampler`, its ``state_dict()`` or a :class:`~fsdp_optim.DataPosition`, equal on
    every rank), recorded in the manifest; ``load_checkpoint(..., data=sampler)`` restores it at any world size.
    Nothing is modified. A failure on any rank raises on every rank, with no
    checkpoint written. Returns the manifest's path: a ``pathlib.Path`` in a local directory, an
    :class:`~fsdp_optim.disk.location.ObjectPath` (printed as its URL) in any other location, whose objects have no
    local path. A checkpoint of ours already in ``path`` is replaced (the new manifest commits first);
    ``overwrite=True`` only allows writing beside files fsdp_optim did not write.

    Resulting directory (see :mod:`fsdp_optim.formats.sharded.training`)::

        path/manifest.json                                     # written last
        path/optim-<id>-rank00000-of-00002.safetensors          # weights + optimizer state of rank 0
        path/train-<id>-rank00000-of-00002.safetensors          # extra (+ buffers) of rank 0
    """
    return cast("Path | ObjectPath", _save_whole(model, optim, path, extra, overwrite, data, background=False))


def async_save_checkpoint(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    path: str | os.PathLike[str] | Location,
    *,
    extra: object = None,
    overwrite: bool = False,
    data: object = None,
) -> AsyncSave:
    """:func:`save_checkpoint` in the background: returns an :class:`~fsdp_optim.AsyncSave` handle once the state
    is checked, the buffers and ``extra`` copied and a save id agreed (a collective: call on every rank).

    The weight shards and optimizer state are copied into reused host buffers by a background thread, which then
    writes the files and commits the manifest; ``optim``'s next ``step()`` or ``load_state_dict()``,
    ``load_checkpoint`` (with or without an optimizer), the model's ``load_state_dict()`` and any other optimizer's
    ``step()`` over its parameters wait for the copy (call ``handle.wait_staged()`` before changing them by other
    means). The call reads no tensor's value on the host (no wait for the GPU), GPU buffers and ``extra`` aside.
    ``handle.wait()`` returns the manifest path or raises the save's error on every rank. One save per model in
    flight; the next one waits for it.
    """
    return cast(AsyncSave, _save_whole(model, optim, path, extra, overwrite, data, background=True))


def _save_whole(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    path: str | os.PathLike[str] | Location,
    extra: object,
    overwrite: bool,
    data: object,
    *,
    background: bool,
) -> Path | ObjectPath | AsyncSave:
    """Either save: checked in, prepared and begun alike; committed at once, or by an async save's thread."""
    purpose = "async_save_checkpoint" if background else "save_checkpoint"
    with interrupts_deferred(purpose):  # a Ctrl-C: held until the save (async: its start) ended as agreed everywhere
        if background:
            finish_previous(model)
        root = verify_root(model, optim)
        check_in(purpose, root.group, check_in_seconds(), alive=liveness_group(root.group))  # (no abort)
        keep_liveness_group(root.group)  # a later save's check-in sees a dead rank at once
        # async: every rank checked in, so its gloo group is made at once, or a rank is lost
        group = checkpoint_group(root.group, meet_s=MEET_S) if background else root.group
        prepared, side = prepare_whole(
            root, model, optim, extra, copy_buffers=background, data=data, caller_of=group if background else None
        )
        directory = where(path)
        optimizer = type(optim).__name__ if optim is not None else None
        save_id, lock = start_save(directory, group, overwrite=overwrite, purpose=purpose)
        upload = lambda state: commit_save(  # noqa: E731 - releases the lock whatever happens
            root.layout, prepared.local, state, optimizer, directory, save_id, group, lock=lock, side=side
        )
        if not background:
            return upload(prepared.state)
        assert optim is not None, "async_save_checkpoint takes an optimizer"
        return launch(model, directory, optim, prepared.state, upload, name=save_id[:8])


def prepare_whole(
    root: Root,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    extra: object,
    *,
    copy_buffers: bool = False,
    data: object = None,
    caller_of: ProcessGroup | None = None,
) -> tuple[_Prepared, Side]:
    """A whole save's checked input on every rank (agreed: a failure anywhere raises everywhere, nothing written) and
    its :class:`Side` (the side file writer and the manifest's training section); the buffers are saved per rank when
    they differ across ranks (one digest per rank, all-gathered). Reads only: the tensors are the live ones, copied
    through the stager's pinned ring when on a GPU, unless ``copy_buffers``: then the buffers and ``extra``'s tensors
    are copied once into host memory, as a save that writes after the call returns needs (forward changes buffers).
    ``caller_of``: the blocking part of an async save, agreed over that (gloo) group and reading no optimizer scalar,
    so that the caller never waits for its GPU (the buffers are copied to the host here: GPU buffers still do)."""
    group = caller_of if caller_of is not None else root.group
    with step("save_checkpoint refused its input, nothing was written", group=group):
        read = caller_of is None
        local = read_for_save(root, optim, read_scalars=read) if optim is not None else LocalState((), {}, {})
        state: dict[int, dict[str, Any]] = {}
        for i, shard in weight_shards(root).items():
            entries = {key: own_tensor(value) for key, value in local.state.get(i, {}).items()}
            state[i] = {**entries, WEIGHTS_KEY: own_tensor(shard)}
        live = persistent_buffers(model)
        buffers = {name: host_copy(b) if copy_buffers else own_tensor(b) for name, b in live.items()}
        extra_ = encode_extra(extra, copy=copy_buffers)
        prepared = _Prepared(local, state, buffers, extra_, read_aliases(model, root.layout), data_position(data))
    gathered = all_gather_objects((buffers_digest(prepared.buffers), prepared.data), group)
    agreed_position([position for _, position in gathered])  # equal on every rank, or the same error on each
    per_rank = len({digest for digest, _ in gathered}) > 1
    return prepared, Side(write=partial(_write_side, prepared, per_rank), record=partial(_training, prepared, per_rank))


def _write_side(
    prepared: _Prepared, per_rank: bool, directory: Path, save_id: str, rank: int, size: int, *, durable: bool = True
) -> FileRecord:
    buffers = prepared.buffers if per_rank or rank == 0 else {}
    return write_side_file(
        directory, save_id=save_id, rank=rank, world_size=size, buffers=buffers, extra=prepared.extra, durable=durable,
        pieces=pieces,
    )  # fmt: skip


def _training(prepared: _Prepared, per_rank: bool, files: tuple[FileRecord, ...]) -> TrainingRecord:
    specs = tuple(BufferSpec(n, tuple(b.shape), dtype_to_str(b.dtype)) for n, b in prepared.buffers.items())
    return TrainingRecord(
        buffers=specs, buffers_per_rank=per_rank, aliases=prepared.aliases, files=files, data=prepared.data
    )
