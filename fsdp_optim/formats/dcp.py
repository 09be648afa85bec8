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
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import Plan, Source, assemble_full, plan, restrict
from fsdp_optim.disk.staged import Survey
from fsdp_optim.formats.fairseq.shards import WEIGHT

__all__ = ["DCP_DIRECTORY", "METADATA", "model_dict", "optim_dict", "write_dcp"]

Progress = Callable[[], None] | None


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


def optim_dict(
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


def model_dict(
    weights: Source,
    order: Sequence[str],
    trim: Callable[[], None],
    producers: dict[int, Any],
    progress: Progress,
    *,
    aliases: Mapping[str, str],
    buffers: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """The model's entry of a DCP save: ``{name: placeholder}`` whose tensors ``producers`` make when DCP asks,
    plus ``aliases`` (tied names) and ``buffers`` as given."""
    the_plan = plan(weights, _per_parameter(weights, order))
    out: dict[str, Any] = {}
    for t in the_plan.flats:
        spec = the_plan.target.flat_params[t].params[0]
        dtype = the_plan.target.flat_params[t].dtype
        make = _maker(the_plan, t, WEIGHT, spec.shape, trim, progress)
        out[spec.name] = _placeholder(spec.shape, dtype, make, producers)
    out.update({alias: out[name] for alias, name in aliases.items()})
    out.update(buffers)
    return out


# ---------------------------------------------------------------------------------------------------
# Sources


def write_dcp(state: Mapping[str, Any], producers: Mapping[int, Callable[[], torch.Tensor]], staging: Path) -> None:
    """Save ``state`` as a DCP checkpoint into ``staging`` with no process group; placeholder tensors are made
    by ``producers`` one at a time as DCP's writer asks for them."""
    writer = FileSystemWriter(staging, single_file_per_rank=False, thread_count=1, sync_files=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dist_cp.save(dict(state), storage_writer=writer, planner=_LazyPlanner(producers), no_dist=True)


class _DcpClaims:
    """A DCP output directory (for :mod:`fsdp_optim.disk.staged`): it must be new or empty; its files are DCP's
    (``.metadata`` written last is the commit point; ``__<rank>_<n>.distcp`` the data)."""

    def survey(self, directory: Path) -> Survey:  # noqa: ARG002 - nothing in an existing directory is ours
        return Survey(overwrite_means="write there anyway")

    def created(self, entry: Mapping[str, Any]) -> set[str]:  # noqa: ARG002 - known only once DCP has written
        return set()

    def tagged(self, entry: Mapping[str, Any]) -> set[tuple[str, str]]:  # noqa: ARG002
        return set()

    def referenced(self, directory: Path) -> set[str]:
        names = set(os.listdir(directory))
        return names if METADATA in names else set()  # committed: keep everything; else what was moved in goes

    def deletable(self, name: str) -> bool:
        return _DCP_FILE.match(name) is not None


METADATA = ".metadata"
_DCP_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
DCP_DIRECTORY = _DcpClaims()
