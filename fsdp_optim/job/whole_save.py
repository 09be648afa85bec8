"""Saving the whole training state in one sharded checkpoint: weights, buffers, optimizer state and ``extra``.

Orchestration only: every rank's weight shards go into its rank file beside its optimizer state (one more state
key per unit, :data:`~fsdp_optim.core.records.WEIGHTS_KEY`), its ``extra`` and (rank 0, or every rank when they
differ) the buffers into its side file (:mod:`fsdp_optim.formats.sharded.side_file`), and rank 0 commits one
manifest last (:func:`fsdp_optim.job.sharded.commit_save`): the checkpoint exists whole or not at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.side_file import encode_extra, write_side_file
from fsdp_optim.formats.sharded.training import BufferSpec, TrainingRecord
from fsdp_optim.job.local import LocalState
from fsdp_optim.job.model_state import buffers_digest, persistent_buffers, weight_shards
from fsdp_optim.job.root import Root, read_aliases, verify_root
from fsdp_optim.job.sharded import Side, commit_save, own_tensor, read_for_save, start_save
from fsdp_optim.job.transport import agree, all_gather_objects

__all__ = ["save_checkpoint"]


@dataclass(frozen=True)
class _Prepared:
    """One rank's part of a whole checkpoint, checked and ready to write (tensors not copied)."""

    local: LocalState
    state: dict[int, dict[str, Any]]  # {flat: {optimizer key or WEIGHTS_KEY: padded shard or scalar}}
    buffers: dict[str, torch.Tensor]
    extra: tuple[str, dict[str, torch.Tensor]]  # encode_extra's (JSON text, tensors)
    aliases: tuple[tuple[str, str], ...]


def save_checkpoint(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    extra: Any = None,
    overwrite: bool = False,
) -> Path:
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
    ``r % saved_world_size``'s). Nothing is modified. A failure on any rank raises on every rank, with no
    checkpoint written. Returns the manifest's path.

    Resulting directory (see :mod:`fsdp_optim.formats.sharded.training`)::

        path/manifest.json                                     # written last
        path/optim-<id>-rank00000-of-00002.safetensors          # weights + optimizer state of rank 0
        path/train-<id>-rank00000-of-00002.safetensors          # extra (+ buffers) of rank 0
    """
    root = verify_root(model, optim)
    prepared, failure = None, None
    try:
        prepared = _prepare(root, model, optim, extra)
    except Exception as exc:  # every rank learns of it through agree(), with nothing written
        failure = exc
    agree(failure, group=root.group, what="save_checkpoint refused its input, nothing was written")
    assert prepared is not None, "agree() raises on every rank when any rank failed"
    per_rank = len(set(all_gather_objects(buffers_digest(prepared.buffers), root.group))) > 1
    directory = Path(path)
    save_id, lock = start_save(directory, root.group, overwrite=overwrite, purpose="save_checkpoint")
    side = Side(write=partial(_write_side, prepared, per_rank), record=partial(_training, prepared, per_rank))
    optimizer = type(optim).__name__ if optim is not None else None
    return commit_save(
        root.layout, prepared.local, prepared.state, optimizer, directory, save_id, root.group, lock=lock, side=side
    )


def _prepare(root: Root, model: nn.Module, optim: torch.optim.Optimizer | None, extra: Any) -> _Prepared:
    """Read and check everything this rank saves (reads only; the tensors are the live ones unless on a GPU)."""
    local = read_for_save(root, optim) if optim is not None else LocalState((), {}, {})
    state: dict[int, dict[str, Any]] = {}
    for i, shard in weight_shards(root).items():
        entries = {key: own_tensor(value) for key, value in local.state.get(i, {}).items()}
        state[i] = {**entries, WEIGHTS_KEY: own_tensor(shard)}
    buffers = {name: own_tensor(b) for name, b in persistent_buffers(model).items()}
    return _Prepared(local, state, buffers, encode_extra(extra), read_aliases(model, root.layout))


def _write_side(prepared: _Prepared, per_rank: bool, directory: Path, save_id: str, rank: int, size: int) -> FileRecord:
    buffers = prepared.buffers if per_rank or rank == 0 else {}
    return write_side_file(
        directory, save_id=save_id, rank=rank, world_size=size, buffers=buffers, extra=prepared.extra
    )


def _training(prepared: _Prepared, per_rank: bool, files: tuple[FileRecord, ...]) -> TrainingRecord:
    specs = tuple(BufferSpec(n, tuple(b.shape), dtype_to_str(b.dtype)) for n, b in prepared.buffers.items())
    return TrainingRecord(buffers=specs, buffers_per_rank=per_rank, aliases=prepared.aliases, files=files)
