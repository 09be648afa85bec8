"""``to_dcp``: any source (full dict, sharded checkpoint, fairseq/metaseq shard set) written as a PyTorch DCP
checkpoint through the writer of :mod:`fsdp_optim.formats.dcp`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.flatten import clone_value
from fsdp_optim.core.plan import Source
from fsdp_optim.disk.atomic import load_file
from fsdp_optim.disk.locks import lock_output
from fsdp_optim.formats.dcp import Progress, model_dict, optim_dict, write_dcp
from fsdp_optim.formats.fairseq.checks import ParamOrder
from fsdp_optim.formats.fairseq.files import OPTIM_KEY, is_shard_set
from fsdp_optim.formats.fairseq.shards import ShardSet
from fsdp_optim.formats.fullstate import full_dict_source
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES, ShardedCheckpoint, source_kind
from fsdp_optim.offline.layouts import param_names


@dataclass(frozen=True)
class DcpExport:
    """What :func:`to_dcp` wrote: ``out_dir``, counts, and the source's keys it did not export."""

    path: Path
    model_tensors: int  # entries under the model key (0: the source holds no weights)
    optim_params: int  # parameters with optimizer state
    extras: tuple[str, ...]  # optimizer extras saved under "<optim_key>_extra"
    not_exported: tuple[str, ...]  # other keys of the source (fairseq's cfg, optimizer_history, ...)



def to_dcp(
    source: str | os.PathLike[str] | Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    model_key: str = "model",
    optim_key: str = "optim",
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
        model_key, optim_key: the top-level names, as the loading job's ``dcp.load`` dict spells them.
        param_order, optimizer_keys, allow_globals: for a shard set (see :class:`~fsdp_optim.fairseq.ShardSet`);
            the order of the names in each param group.
        progress: called after each tensor written.

    Load it in an FSDP2 job (every rank)::

        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=out_dir)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"out_dir: {out} exists and is not an empty directory; DCP output needs a directory of its own"
        )
    with _open(source, param_order, optimizer_keys, allow_globals, max_mapped_bytes) as export:
        producers: dict[int, Callable[[], torch.Tensor]] = {}
        optim = optim_dict(export.source, export.order, producers, export.trim, progress)
        state: dict[str, Any] = {}
        model = None
        if export.weights is not None:
            model = model_dict(
                export.weights, export.order, export.trim, producers, progress, aliases=export.aliases, buffers=export.buffers
            )
        if model is not None:
            state[model_key] = model
        state[optim_key] = optim
        if export.extras:
            state[f"{optim_key}_extra"] = dict(export.extras)
        out.parent.mkdir(parents=True, exist_ok=True)
        with lock_output(out, purpose="fsdp_optim.to_dcp"):
            if out.exists() and any(out.iterdir()):  # filled meanwhile, before we held the lock
                raise ValueError(f"out_dir: {out} is no longer empty; DCP needs a directory of its own")
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.dcp-", dir=out.parent))
            try:
                write_dcp(state, producers, staging)
                os.replace(staging, out)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return DcpExport(out, len(model or {}), len(optim["state"]), tuple(export.extras), export.not_exported)



@dataclass
class _Export:
    source: Source
    order: Sequence[str]
    trim: Callable[[], None]
    weights: Source | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    not_exported: tuple[str, ...] = ()
    close: Callable[[], None] | None = None

    def __enter__(self) -> _Export:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.close is not None:
            self.close()



def _open(
    source: str | os.PathLike[str] | Mapping[str, Any],
    param_order: ParamOrder,
    optimizer_keys: Sequence[Sequence[str]] | None,
    allow_globals: Sequence[str],
    max_mapped_bytes: int,
) -> _Export:
    if isinstance(source, Mapping):
        return _full(source, "the full dict")
    if is_shard_set(source):
        shards = ShardSet(
            source,
            param_order=param_names(param_order),
            optimizer_keys=optimizer_keys,
            allow_globals=allow_globals,
            max_mapped_bytes=max_mapped_bytes,
        )
        rank0 = shards.rank0()
        aliases = {**shards.aliases, **{alias: shards.full_name(key) for alias, key in shards.model_aliases.items()}}
        return _Export(
            source=shards.source(),
            order=shards.manifest.param_order,
            trim=shards.trim,
            weights=shards.weights_source(),
            aliases=aliases,
            buffers={name: rank0["model"][name].clone() for name in shards.buffers},
            extras={key: clone_value(rank0[OPTIM_KEY][key]) for key in shards.extras},
            not_exported=tuple(k for k in rank0 if k not in ("model", OPTIM_KEY)),
            close=shards.close,
        )
    if source_kind(source) == "sharded":
        ckpt = ShardedCheckpoint(source, max_mapped_bytes=max_mapped_bytes)
        return _Export(ckpt.source(), ckpt.manifest.param_order, ckpt.trim, close=ckpt.close)
    return _full(load_file(source, mmap=True, disjoint=True), str(source))



def _full(full: Mapping[str, Any], label: str) -> _Export:
    the_source = full_dict_source(full, label=label)
    order = [f.params[0].name for f in the_source.flats]
    return _Export(the_source, order, lambda: None)
