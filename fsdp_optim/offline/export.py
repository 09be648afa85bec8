"""``to_dcp``: any source (full dict, sharded checkpoint, fairseq/metaseq shard set) written as a PyTorch DCP
checkpoint through the writer of :mod:`fsdp_optim.formats.dcp`.

A whole checkpoint (:func:`fsdp_optim.save_checkpoint`) is written in torchtitan's layout, ``{"model": the unwrapped
model's state_dict() (parameters, tied names, rank 0's buffers), "optimizer": {"state": {name: ...},
"param_groups": [...]}}``, which an FSDP2 job loads with ``get_state_dict`` / ``dcp.load`` / ``set_state_dict``
(``set_model_state_dict`` / ``set_optimizer_state_dict``). Every source's optimizer state goes under the same key,
``"optimizer"`` by default (``optim_key``, ``convert --optim-key``): the loading job's ``dcp.load`` dict must
spell it the same, or DCP reports ``Missing key in checkpoint state_dict: <key>.state...``. Its per-rank ``extra``
is not exported (DCP would give every rank one copy): ``fsdp_optim.consolidate(path, rank=r)["extra"]`` reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.disk.local_directory import staged_output
from fsdp_optim.formats.dcp import DCP_DIRECTORY, METADATA, Progress, model_dict, optim_dict, placeholder, write_dcp
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.offline.layouts import ParamOrder
from fsdp_optim.offline.opened.base import Opened
from fsdp_optim.offline.publish import output_for
from fsdp_optim.offline.sources import open_source


@dataclass(frozen=True)
class DcpExport:
    """What :func:`to_dcp` wrote: ``out_dir``, counts, and the source's keys it did not export."""

    path: Path
    model_tensors: int  # entries under the model key (0: the source holds no weights)
    optim_params: int  # parameters with optimizer state
    optim_key: str  # the top-level key the optimizer state went under (its extras: "<optim_key>_extra")
    extras: tuple[str, ...]  # optimizer extras saved under "<optim_key>_extra"
    not_exported: tuple[str, ...]  # other keys of the source (fairseq's cfg, optimizer_history, ...)



def to_dcp(
    source: str | os.PathLike[str] | Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    model_key: str = "model",
    optim_key: str = "optimizer",
    param_order: ParamOrder = None,
    optimizer_keys: Sequence[Sequence[str]] | None = None,
    allow_globals: Sequence[str] = (),
    progress: Progress = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
) -> DcpExport:
    """Write ``source`` as a DCP checkpoint into ``out_dir`` (see the module docstring for its keys).

    Args:
        source: a full dict, or a path: a sharded checkpoint directory (or its manifest), a full dict file,
            or a fairseq/metaseq shard set (any shard file or the path before ``-shard``).
        out_dir: must not exist, or be an empty directory.
        model_key, optim_key: the top-level names, as the loading job's ``dcp.load`` dict must spell them
            (torchtitan's ``{"model", "optimizer"}`` by default, for every source).
        param_order, optimizer_keys, allow_globals: for a shard set (see :class:`~fsdp_optim.fairseq.ShardSet`);
            the order of the names in each param group.
        progress: called after each tensor written.

    Load it in an FSDP2 job (every rank)::

        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optimizer": optim_sd}   # the keys model_key and optim_key name
        dcp.load(state, checkpoint_id=out_dir)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    An optimizer-only source: ``state = {"optimizer": get_optimizer_state_dict(model, optim)}``, then
    ``set_optimizer_state_dict``.
    """
    with output_for(str(out_dir)) as local:  # out_dir, or written locally, then uploaded file by file (publish.py)
        _check_empty(Path(local))
        with open_source(
            source, layout=param_order, optimizer_keys=optimizer_keys, allow_globals=allow_globals,
            max_mapped_bytes=max_mapped_bytes,
        ) as opened:
            return export_opened(opened, local, inputs=(source,), model_key=model_key, optim_key=optim_key,
                                 progress=progress)


def _check_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"out_dir: {out} exists and is not an empty directory; DCP output needs a directory of its own"
        )


def export_opened(
    opened: Opened,
    out_dir: str | os.PathLike[str],
    *,
    inputs: Sequence[Any] = (),
    model_key: str = "model",
    optim_key: str = "optimizer",
    progress: Progress = None,
) -> DcpExport:
    """:func:`to_dcp` of a source already opened by :func:`~fsdp_optim.offline.sources.open_source`."""
    out = Path(out_dir)
    _check_empty(out)
    export = opened.dcp_parts()
    whole = opened.is_whole()
    if not optim_key or optim_key == model_key or "." in optim_key:
        raise ValueError(
            f"optim_key: expected a top-level key without '.', other than the model's ({model_key!r}), found "
            f"{optim_key!r}"
        )
    producers: dict[int, Callable[[], torch.Tensor]] = {}
    optim = optim_dict(export.source, export.order, producers, export.trim, progress)
    state: dict[str, Any] = {}
    model = None
    if whole:  # the unwrapped model's state_dict, each parameter made when the writer asks for it
        weights = opened.whole_model(progress=progress)
        model = weights.entries(lambda p: placeholder(p.shape, p.dtype, p.make, producers))
        state[model_key] = model
        export = replace(export, not_exported=("extra (per rank: fsdp_optim.consolidate(path, rank=r) gives it)",))
    elif export.weights is not None:
        model = model_dict(
            export.weights, export.order, export.trim, producers, progress, aliases=export.aliases,
            buffers=export.buffers,
        )
        state[model_key] = model
    state[optim_key] = optim
    if export.extras:
        state[f"{optim_key}_extra"] = dict(export.extras)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_output(out, DCP_DIRECTORY, purpose="fsdp_optim.to_dcp", inputs=inputs) as stage:
        stage.last = (METADATA,)
        write_dcp(state, producers, stage.dir)
    return DcpExport(out, len(model or {}), len(optim["state"]), optim_key, tuple(export.extras), export.not_exported)
