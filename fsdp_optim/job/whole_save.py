"""Saving the whole training state in one sharded checkpoint: weights, buffers, optimizer state and ``extra``.

Every rank's weight shards go into its rank file beside its optimizer state (one more state key per unit,
:data:`~fsdp_optim.core.records.WEIGHTS_KEY`), its ``extra`` and the buffers into its side file
(:mod:`fsdp_optim.formats.sharded.side_file`), through :func:`fsdp_optim.job.save_commit.commit_save`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.data_position import DataPosition
from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.disk.location import Location, ObjectPath
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.side_file import encode_extra, write_side_file
from fsdp_optim.formats.sharded.training import BufferSpec, TrainingRecord
from fsdp_optim.job.agreed import interrupts_deferred, step
from fsdp_optim.job.async_save import (
    MEET_S,
    AsyncSave,
    check_in_alive,
    checkpoint_group,
    finish_previous,
    launch,
    staging_of,
)
from fsdp_optim.job.local import LocalState
from fsdp_optim.job.model_state import buffers_digest, persistent_buffers, weight_shards
from fsdp_optim.job.root import Root, read_aliases, verify_root
from fsdp_optim.job.sampler import agreed_position, data_position
from fsdp_optim.job.save_commit import commit_save, own_tensor, read_for_save, start_save
from fsdp_optim.job.stager import Copier, pieces
from fsdp_optim.job.staging import HostStaging
from fsdp_optim.job.transport import ProcessGroup, all_gather_objects

__all__ = ["async_save_checkpoint", "prepare_whole", "save_checkpoint"]


@dataclass
class _Prepared:
    """One rank's part of a whole checkpoint, checked (tensors not copied), and its side files (a
    :class:`~fsdp_optim.job.save_commit.Side`) once :meth:`agree` has compared the buffers across ranks: in rank 0's
    side file alone, or in every rank's when they differ."""

    local: LocalState
    state: dict[int, dict[str, Any]]  # {flat: {optimizer key or WEIGHTS_KEY: padded shard or scalar}}
    buffers: dict[str, torch.Tensor]
    extra: tuple[str, dict[str, torch.Tensor]]  # encode_extra's (JSON text, tensors)
    aliases: tuple[tuple[str, str], ...]
    data: DataPosition | None = None  # the data stream's position (data=), the same on every rank
    landed: tuple[tuple[Copier, Any], ...] = ()  # an async save's: the buffers and extra are read once these are done
    per_rank: bool | None = None  # whether the buffers differ across ranks (:meth:`agree`)

    def agree(self, group: ProcessGroup) -> None:
        """Whether the buffers differ across ranks: one digest per rank, all-gathered (a collective)."""
        self.per_rank = len(set(all_gather_objects(buffers_digest(self.buffers), group))) > 1

    def after(self, staged: Callable[[], dict[int, dict[str, Any]]], group: ProcessGroup) -> Callable[[], Any]:
        """An async save's state for :func:`commit_save`, in its thread: ``staged()``, the buffers and ``extra``
        landed on the host (agreed on every rank), then :meth:`agree`."""

        def state() -> dict[int, dict[str, Any]]:
            with step("the copy into host memory failed, no checkpoint was written", group=group):
                copied = staged()
                for copier, ticket in self.landed:
                    copier.wait(ticket)
            self.agree(group)
            return copied

        return state

    def write(self, directory: Path, save_id: str, rank: int, size: int, *, durable: bool = True) -> FileRecord:
        assert self.per_rank is not None, "the buffers are compared across ranks before a side file is written"
        buffers = self.buffers if self.per_rank or rank == 0 else {}
        return write_side_file(
            directory, save_id=save_id, rank=rank, world_size=size, buffers=buffers, extra=self.extra,
            durable=durable, pieces=pieces,
        )  # fmt: skip

    def record(self, files: tuple[FileRecord, ...]) -> TrainingRecord:
        assert self.per_rank is not None, "the buffers are compared across ranks before the manifest is built"
        specs = tuple(BufferSpec(n, tuple(b.shape), dtype_to_str(b.dtype)) for n, b in self.buffers.items())
        return TrainingRecord(
            buffers=specs, buffers_per_rank=self.per_rank, aliases=self.aliases, files=files,
            data=self.data,
        )  # fmt: skip


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
    with interrupts_deferred("save_checkpoint"):  # a Ctrl-C: the save ends as agreed on every rank, then raises
        root = verify_root(model, optim)
        check_in_alive("save_checkpoint", root.group)  # a rank calling it alone, or a dead one: said so, no abort
        prepared = prepare_whole(root, model, optim, extra, data=data)
        directory = where(path)
        optimizer = type(optim).__name__ if optim is not None else None
        save_id, lock = start_save(directory, root.group, overwrite=overwrite, purpose="save_checkpoint")
        return commit_save(  # at once: from here, commit_save releases the lock whatever happens
            root.layout, prepared.local, prepared.state, optimizer, directory, save_id, root.group, lock=lock,
            side=prepared,
        )  # fmt: skip


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
    is checked, the buffers and ``extra`` copied (on a GPU: queued) and a save id agreed (a collective: call on
    every rank).

    The weight shards and optimizer state are copied into reused host buffers by a background thread, which then
    writes the files and commits the manifest; ``optim``'s next ``step()`` or ``load_state_dict()``,
    ``load_checkpoint`` (with or without an optimizer), the model's ``load_state_dict()`` and any other optimizer's
    ``step()`` over its parameters wait for the copy (call ``handle.wait_staged()`` before changing them by other
    means). The call reads no tensor's value on the host (no wait for the GPU); the caller's stream waits on the GPU
    for the copies of the GPU buffers and ``extra``'s tensors (a forward changes buffers in place).
    ``handle.wait()`` returns the manifest path or raises the save's error on every rank. One save per model in
    flight; the next one waits for it.
    """
    with interrupts_deferred("async_save_checkpoint"):  # its agreed start (the thread does not see Ctrl-C)
        finish_previous(model)
        root = verify_root(model, optim)
        check_in_alive("async_save_checkpoint", root.group)
        group = checkpoint_group(root.group, meet_s=MEET_S)  # every rank checked in: made at once, or a rank is lost
        prepared = prepare_whole(root, model, optim, extra, caller_of=group, data=data)
        directory = where(path)
        save_id, lock = start_save(directory, group, overwrite=overwrite, purpose="async_save_checkpoint")
        optimizer = type(optim).__name__
        upload = lambda staged: commit_save(  # noqa: E731 - the thread's whole job, in one call
            root.layout, prepared.local, prepared.after(staged, group), optimizer, directory, save_id, group, lock=lock,
            side=prepared,
        )  # fmt: skip
        return launch(model, directory, optim, prepared.state, upload, name=save_id[:8])


def prepare_whole(
    root: Root,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    extra: object,
    *,
    data: object = None,
    caller_of: ProcessGroup | None = None,
) -> _Prepared:
    """A whole save's checked input on every rank (agreed), for every saver. ``caller_of``: the blocking part of an
    async save, agreed over that (gloo) group, reading no optimizer scalar and copying the buffers and ``extra``'s
    tensors through the root's staging (GPU ones queued only): the caller never waits for its GPU; the buffers are
    then compared in the save's thread (:meth:`_Prepared.after`)."""
    group = caller_of if caller_of is not None else root.group
    with step("save_checkpoint refused its input, nothing was written", group=group):
        prepared = _prepare(root, model, optim, extra, staging_of(model) if caller_of is not None else None, data=data)
    agreed_position(all_gather_objects(prepared.data, group))  # equal on every rank, or the same error on each
    if caller_of is None:
        prepared.agree(group)
    return prepared


def _prepare(
    root: Root,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    extra: object,
    staging: HostStaging | None,
    *,
    data: object = None,
) -> _Prepared:
    """Read and check everything this rank saves (the live tensors; with ``staging``, an async save's, the buffers and
    ``extra``'s tensors are copied into it at once: a forward changes buffers)."""
    local = read_for_save(root, optim, read_scalars=staging is None) if optim is not None else LocalState((), {}, {})
    state: dict[int, dict[str, Any]] = {}
    for i, shard in weight_shards(root).items():
        entries = {key: own_tensor(value) for key, value in local.state.get(i, {}).items()}
        state[i] = {**entries, WEIGHTS_KEY: own_tensor(shard)}
    buffers = {name: own_tensor(b) for name, b in persistent_buffers(model).items()}
    text, tensors = encode_extra(extra)
    landed: list[tuple[Copier, Any]] = []
    if staging is not None:
        named = {**{f"b/{n}": b for n, b in buffers.items()}, **{f"x/{k}": t for k, t in tensors.items()}}
        copies, landed = staging.side_copy(named)
        buffers = {n: copies[f"b/{n}"] for n in buffers}
        tensors = {k: copies[f"x/{k}"] for k in tensors}
    aliases = read_aliases(model, root.layout)
    return _Prepared(local, state, buffers, (text, tensors), aliases, data_position(data), tuple(landed))
