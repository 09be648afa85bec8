"""Export to PyTorch Distributed Checkpoint (DCP), offline, in one process, one tensor at a time.

:func:`to_dcp` writes any source (a sharded checkpoint of ours, a full dict or its file, a fairseq/metaseq
shard set) as a DCP checkpoint that an FSDP2 job (``torch.distributed.fsdp.fully_shard``) of any world size
loads with ``dcp.load`` + ``set_state_dict``. The state dict it saves is keyed as
``torch.distributed.checkpoint.state_dict.get_state_dict`` names things::

    {"model": {"embed.weight": Tensor[11, 6], ..., "head.weight": <same>, buffers},   # when the source has weights
     "optim": {"state": {"embed.weight": {"exp_avg": Tensor[11, 6], "step": tensor(2.)}, ...},
               "param_groups": [{"lr": 0.01, ..., "params": ["embed.weight", ...]}, ...]},
     "optim_extra": {"loss_scale": 64.0}}                                               # a wrapper's extras, if any

Every tensor is a full (unsharded) tensor by unwrapped name; DCP cuts what each rank of the loading job
reads. Streaming: the plan (:func:`fsdp_optim.plan.plan`, target = one flat per parameter) is made before
anything is written; DCP's planner is handed zero-stride placeholders and makes each real tensor only when
the writer asks for it (:class:`_LazyPlanner`), reading just that parameter's range of the source. DCP's
writer keeps every tensor of one file until the file is closed, so each item gets a file of its own
(``single_file_per_rank=False``). ``dcp.save`` runs with ``no_dist=True``: no process group, even inside a job.

All-or-nothing: written into a staging directory beside ``out_dir`` and renamed onto it when complete;
``out_dir`` must not exist or be empty, and is locked while written (a second writer gets ``OutputLockedError``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .fairseq import WEIGHT, ShardSet
from .fairseq_checks import ParamOrder
from .fairseq_format import OPTIM_KEY, is_shard_set
from .flatten import StateKind, clone_value
from .fullstate import full_dict_source
from .layout import FlatParamLayout, ModelLayout, ParamSpec
from .locks import lock_output
from .plan import Plan, Source, assemble_full, plan, restrict
from .storage import DEFAULT_MAPPED_BYTES, ShardedCheckpoint, load_file, source_kind

__all__ = ["DcpExport", "to_dcp"]

Progress = Callable[[], None] | None


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
        optim = _optim_dict(export.source, export.order, producers, export.trim, progress)
        state: dict[str, Any] = {}
        model = _model_dict(export, producers, progress) if export.weights is not None else None
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
                writer = FileSystemWriter(staging, single_file_per_rank=False, thread_count=1, sync_files=True)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                    dist_cp.save(state, storage_writer=writer, planner=_LazyPlanner(producers), no_dist=True)
                os.replace(staging, out)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return DcpExport(out, len(model or {}), len(optim["state"]), tuple(export.extras), export.not_exported)


class _LazyPlanner(DefaultSavePlanner):
    """DCP's default planner, except that a placeholder tensor is made real only when the writer asks for it."""

    def __init__(self, producers: Mapping[int, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self._producers = producers

    def resolve_data(self, write_item: WriteItem) -> Any:
        obj = self.lookup_object(write_item.index)
        if write_item.type != WriteItemType.BYTE_IO and id(obj) in self._producers:
            return self._producers[id(obj)]()
        return super().resolve_data(write_item)


def _placeholder(
    shape: tuple[int, ...], dtype: torch.dtype, make: Callable[[], torch.Tensor], producers: dict[int, Any]
) -> torch.Tensor:
    """A tensor of the right shape and dtype that owns one element (zero strides); ``make`` gives the real one."""
    tensor = torch.zeros((), dtype=dtype).expand(shape)
    producers[id(tensor)] = make
    return tensor


def _optim_dict(
    source: Source, order: Sequence[str], producers: dict[int, Any], trim: Callable[[], None], progress: Progress
) -> dict[str, Any]:
    """``{"state": {name: entries}, "param_groups": [...]}`` with placeholders; planned for one flat per parameter."""
    the_plan = plan(source, _per_parameter(source, order))
    rank = {name: i for i, name in enumerate(order)}
    names = [f.params[0].name for f in the_plan.target.flat_params]
    state: dict[str, Any] = {}
    for t in sorted(the_plan.flats, key=lambda t: rank[names[t]]):
        spec = the_plan.target.flat_params[t].params[0]
        entries: dict[str, Any] = {}
        for e in the_plan.flats[t].entries:
            if e.kind is StateKind.SCALAR:
                entries[e.key] = clone_value(e.value)
            else:
                make = _maker(the_plan, t, e.key, spec.shape, trim, progress)
                entries[e.key] = _placeholder(spec.shape, getattr(torch, str(e.dtype)), make, producers)
        state[spec.name] = entries
    groups = []
    for group in the_plan.groups:
        params = sorted((names[t] for t in group.flat_indices), key=rank.__getitem__)
        groups.append({**{k: clone_value(v) for k, v in group.hyperparams.items()}, "params": params})
    return {"state": state, "param_groups": groups}


def _maker(
    the_plan: Plan, t: int, key: str, shape: tuple[int, ...], trim: Callable[[], None], progress: Progress
) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        tensor = assemble_full(restrict(the_plan, t, key))[t][key].view(shape)
        trim()
        if progress is not None:
            progress()
        return tensor

    return make


def _per_parameter(source: Source, order: Sequence[str]) -> ModelLayout:
    """The source's parameters, each a flat of its own at world size 1: the target that makes full tensors."""
    flats = tuple(
        FlatParamLayout(flat.unit, (ParamSpec(spec.name, spec.shape, 0),), 1, 0, flat.dtype, False)
        for flat in source.flats
        for spec in flat.params
    )
    return ModelLayout(flats, tuple(order), 1, 0)


def _model_dict(export: _Export, producers: dict[int, Any], progress: Progress) -> dict[str, Any]:
    weights = export.weights
    assert weights is not None, "a source with weights"
    the_plan = plan(weights, _per_parameter(weights, export.order))
    out: dict[str, Any] = {}
    for t in the_plan.flats:
        spec = the_plan.target.flat_params[t].params[0]
        dtype = the_plan.target.flat_params[t].dtype
        make = _maker(the_plan, t, WEIGHT, spec.shape, export.trim, progress)
        out[spec.name] = _placeholder(spec.shape, dtype, make, producers)
    out.update({alias: out[name] for alias, name in export.aliases.items()})
    out.update(export.buffers)
    return out


# ---------------------------------------------------------------------------------------------------
# Sources


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
            param_order=param_order,
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
    return _full(load_file(source, mmap=True), str(source))


def _full(full: Mapping[str, Any], label: str) -> _Export:
    the_source = full_dict_source(full, label=label)
    order = [f.params[0].name for f in the_source.flats]
    return _Export(the_source, order, lambda: None)
