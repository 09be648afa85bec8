"""Offline work on checkpoints, no process group, no model: :func:`consolidate` (a sharded checkpoint -> its full
dict) and :func:`reshard` (any source -> a sharded checkpoint for ``world_size`` ranks). Both open their input
(:func:`~fsdp_optim.offline.sources.open_source`) and ask it; its class plans once and executes the plan
(:mod:`fsdp_optim.offline.cuts`).

Memory: rank files are memory-mapped and read one FSDP unit at a time; mappings are dropped whenever
the touched pages exceed ``max_mapped_bytes``. ``consolidate`` therefore peaks near the size of the
full dict it returns plus that bound; ``reshard`` writes one output rank at a time and peaks near one
output shard plus that bound.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_optim.core.preconditions import check_full_dict, check_world_size
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.objects import check_state_dict
from fsdp_optim.disk.untrusted import load_file
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.formats.sharded.side_file import check_buffer_choice
from fsdp_optim.offline.cuts import Progress
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.publish import checkpoint_output
from fsdp_optim.offline.sources import open_source

__all__ = ["consolidate", "load_full_file", "reshard", ]


def load_full_file(
    path: str | os.PathLike[str], label: str | None = None, *, mmap: bool = True, disjoint: bool = False
) -> dict[str, Any]:
    """A full dict from a file (memory-mapped unless ``mmap=False``; ``disjoint``: as
    :func:`~fsdp_optim.disk.untrusted.load_file` takes it); ``ValueError`` naming ``label`` if it is something else."""
    full = load_file(path, mmap=mmap, disjoint=disjoint)
    check_full_dict(full, label or str(path))
    check_state_dict(full, label or str(path))
    return dict(full)


def consolidate(
    path: str | os.PathLike[str],
    *,
    layout: LayoutLike | None = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    rank: int | None = None,
    with_model: bool | None = None,
) -> dict[str, Any]:
    """The full dict of a sharded checkpoint, without a process group or the model.

    ``path`` is the checkpoint directory (or its manifest). Every rank file's header and every unit's
    checksum are verified as they are read. Returns the dict that ``gather_full_optim_state_dict``
    returned at save time (``{"state", "param_groups", "param_names", "fsdp_optim"}``, all tensors new
    CPU memory), bit for bit. ``progress`` is called after each unit.

    A fairseq/metaseq shard set gives its optimizer's full dict (the wrapper's extras, such as
    ``loss_scale``, kept as keys of it); :func:`fsdp_optim.fairseq.consolidate_shards` gives the rest too.
    A fairscale-native dict file is converted (``layout`` required, see :func:`fsdp_optim.from_fairscale`).
    ``layout``, ``optimizer`` and ``allow_globals`` apply as :mod:`fsdp_optim.offline.sources` says.

    A whole checkpoint (:func:`fsdp_optim.save_checkpoint`) gives the unwrapped model too, in one dict::

        {"model": {"embed.weight": Tensor[11, 6], ..., "head.weight": <embed.weight's tensor>, buffers},
         "optimizer": <the full dict above> (None when saved with optim=None),
         "extra": <saved rank 0's extra>}

    ``model.load_state_dict(out["model"])`` (``strict=True``) loads it into the model without FSDP, and a plain
    optimizer over its ``named_parameters()`` grouped as in the job takes ``out["optimizer"]`` (ids follow the
    groups, as :func:`fsdp_optim.gather_full_optim_state_dict` numbers them); see :mod:`fsdp_optim.offline.whole`.
    ``rank``: whose side file gives ``extra`` (and the buffers, required when they were saved per rank);
    ``with_model=False``: the optimizer's full dict alone, as for an optimizer-only checkpoint. Both apply to a
    whole checkpoint only.
    """
    with open_source(
        path, layout=layout, optimizer=optimizer, allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes
    ) as opened:
        return opened.consolidated(rank=rank, with_model=with_model, progress=progress)


def reshard(
    source: str | os.PathLike[str] | Mapping[str, Any],
    world_size: int,
    out_dir: str | os.PathLike[str] | Location,
    *,
    layout: LayoutLike | None = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    overwrite: bool = False,
    buffers: str = "refuse",
    parallel: bool = False,
) -> Path:
    """Write ``source`` as a sharded checkpoint for ``world_size`` ranks into ``out_dir``; returns its manifest.

    Args:
        source: a sharded checkpoint directory (any world size), or a full dict / a file holding one, or a
            fairseq/metaseq shard set (written in its own format, see :func:`fsdp_optim.fairseq.reshard_shards`;
            the return value is then ``out_dir``).
        world_size: ranks of the job that will load it; units that were not sharded stay whole.
        out_dir: created if needed; must not be the source directory. An existing checkpoint there
            is replaced atomically (the manifest is written last).
        layout: required for a full source, which does not say how parameters are grouped into FSDP
            units: a sharded checkpoint or layout file of the same model (any world size), its
            :class:`~fsdp_optim.formats.sharded.manifest.Manifest`, a
            :class:`~fsdp_optim.core.layout.ModelLayout`, or the FSDP-wrapped model.
        progress: called after each shard (a unit's state key) of each output rank (each output rank, by blocks).
        overwrite: write into ``out_dir`` even if it holds files that are not an fsdp_optim checkpoint's
            (they are kept; without it such a directory is refused with ``ForeignOutputError``).
        buffers: a whole checkpoint whose buffers were saved per rank (they differed across ranks, as BatchNorm's
            running statistics do) goes to another world size only with a choice, as in
            :func:`fsdp_optim.load_checkpoint`: ``"refuse"`` (the default: a ``ValueError`` naming this option),
            ``"rank0"`` (saved rank 0's) or ``"mean"`` (each floating-point buffer's mean across the saved ranks,
            rank 0's of integer and bool buffers); the result holds them once, in rank 0's side file. At the saved
            world size they stay per rank, whatever the choice.
        parallel: every process of the process group (or torchrun's) calls it alike and writes a share of the
            files into a directory all see; one commit (:mod:`fsdp_optim.offline.parallel`); ``progress`` unused.

    ``out_dir`` is locked while it is written (a second writer gets ``OutputLockedError``) and must not
    resolve to any input; ``world_size`` is at most :data:`fsdp_optim.core.limits.MAX_WORLD_SIZE`.
    The source is checked against the target once (one plan), then cut once per output rank.
    """
    check_world_size("world_size", world_size)
    check_buffer_choice(buffers)
    if parallel:
        from fsdp_optim.offline.parallel.entry import reshard_in_team

        return reshard_in_team(None, source, world_size, out_dir, layout=layout, optimizer=optimizer,
                               allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes, overwrite=overwrite,
                               buffers=buffers)  # fmt: skip
    with checkpoint_output(out_dir, overwrite=overwrite) as (local, file_done), open_source(
        source, layout=layout, optimizer=optimizer, allow_globals=allow_globals, target=True,
        max_mapped_bytes=max_mapped_bytes,
    ) as opened:  # (a store's output: each rank file uploaded once written)
        written = opened.reshard(world_size, Path(local), layout=layout, given=source, progress=progress,
                                 overwrite=overwrite, after_file=file_done, buffers=buffers)  # fmt: skip
    if file_done is None:  # written in place
        return written
    return where(out_dir) / MANIFEST_NAME  # type: ignore[return-value]  # shown as its URL
