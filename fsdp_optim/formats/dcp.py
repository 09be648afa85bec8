"""Export to PyTorch Distributed Checkpoint (DCP), offline, in one process, one tensor at a time.

:func:`to_dcp` writes any source (a sharded checkpoint of ours, a full dict or its file, a fairseq/metaseq
shard set) as a DCP checkpoint that an FSDP2 job (``torch.distributed.fsdp.fully_shard``) of any world size
loads with ``dcp.load`` + ``set_state_dict``. The state dict it saves is keyed as
``torch.distributed.checkpoint.state_dict.get_state_dict`` names things::

    {"model": {"embed.weight": Tensor[11, 6], ..., "head.weight": <same>, buffers},   # when the source has weights
     "optimizer": {"state": {"embed.weight": {"exp_avg": Tensor[11, 6], "step": tensor(2.)}, ...},
                   "param_groups": [{"lr": 0.01, ..., "params": ["embed.weight", ...]}, ...]},
     "optimizer_extra": {"loss_scale": 64.0}}                                           # a wrapper's extras, if any

(``"optimizer"``: ``to_dcp``'s ``optim_key``, torchtitan's key by default; ``inspect`` finds the state under any.)

Every tensor is full (unsharded), by unwrapped name; DCP cuts what each rank of the loading job reads. The plan
(target: one flat per parameter) is made before anything is written; DCP's planner gets zero-stride placeholders
and makes each real tensor only when the writer asks for it (:class:`_LazyPlanner`).

Files: one data file, ``__0_0.distcp`` (a one-rank save's name), plus ``.metadata``. DCP's own
``FileSystemWriter`` keeps every tensor of a file referenced until it closes the file, so :class:`_StreamingWriter`
appends one item at a time and drops it: memory is one tensor. ``dcp.save`` runs with ``no_dist=True``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fsdp_optim.core.execute import assemble_full, restrict
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.plan import per_parameter, plan
from fsdp_optim.core.source import Plan, Source
from fsdp_optim.formats.fairseq.shards import WEIGHT
from fsdp_optim.formats.hf_safetensors import NewDirectoryClaims

__all__ = [
    "DATA_FILE", "DCP_DIRECTORY", "METADATA", "describe_dcp", "model_dict", "optim_dict", "placeholder", "write_dcp",
]  # fmt: skip

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


def placeholder(
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
    the_plan = plan(source, per_parameter(source, order))
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
                entries[e.key] = placeholder(spec.shape, getattr(torch, str(e.dtype)), make, producers)
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
    the_plan = plan(weights, per_parameter(weights, order))
    out: dict[str, Any] = {}
    for t in the_plan.flats:
        spec = the_plan.target.flat_params[t].params[0]
        dtype = the_plan.target.flat_params[t].dtype
        make = _maker(the_plan, t, WEIGHT, spec.shape, trim, progress)
        out[spec.name] = placeholder(spec.shape, dtype, make, producers)
    out.update({alias: out[name] for alias, name in aliases.items()})
    out.update(buffers)
    return out


# ---------------------------------------------------------------------------------------------------
# Writing


def write_dcp(state: Mapping[str, Any], producers: Mapping[int, Callable[[], torch.Tensor]], staging: Path) -> None:
    """Save ``state`` as a DCP checkpoint into ``staging`` (``DATA_FILE`` and ``METADATA``) with no process
    group; placeholder tensors are made by ``producers`` one at a time as the writer asks for them."""
    writer = _StreamingWriter(staging, thread_count=1, sync_files=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dist_cp.save(dict(state), storage_writer=writer, planner=_LazyPlanner(producers), no_dist=True)


class _StreamingWriter(FileSystemWriter):
    """DCP's file-system writer, except that the data goes into one file, one item resolved, appended and dropped
    at a time. DCP's reader needs each item's ``_StorageInfo(file name, offset, length)`` (its ``WriteResult``):
    ``torch.save`` of a tensor (its storage exactly the tensor's bytes), a byte item's raw bytes. DCP's private
    record, not a copy: the pickled ``.metadata`` must name torch's own class for any reader to load it."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"
        assert name == DATA_FILE, f"a save with no process group is rank 0's, expected {DATA_FILE}, got {name}"
        results = []
        with open(Path(self.path) / name, "wb") as stream:
            for item in plan.items:
                results.append(_append(stream, item, planner, name))
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


def _append(stream: BinaryIO, item: WriteItem, planner: SavePlanner, name: str) -> WriteResult:
    """Write one item at the end of ``stream``; nothing of it stays referenced once this returns."""
    offset = stream.tell()
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO), f"{item.index.fqn}: a byte item resolves to BytesIO, got {type(data)}"
        stream.write(data.getbuffer())
    else:
        assert isinstance(data, torch.Tensor), f"{item.index.fqn}: a tensor item resolved to {type(data)}"
        tensor = data.detach().cpu()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:  # torch.save writes a whole storage
            tensor = tensor.clone()
        torch.save(tensor, stream)
        del tensor
    del data
    length = stream.tell() - offset
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))


METADATA = ".metadata"
DATA_FILE = "__0_0.distcp"  # the one data file: DCP's name for rank 0's first file
_DCP_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
# New or empty; DATA_FILE then METADATA (moved in last: the commit point); other DCP names are deletable too.
DCP_DIRECTORY = NewDirectoryClaims(_DCP_FILE, frozenset({METADATA}), "write there anyway",
                                   frozenset({DATA_FILE, METADATA}))


# ---------------------------------------------------------------------------------------------------
# Reading a DCP directory's .metadata back (inspect): a restricted unpickler, no tensor read

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
}  # fmt: skip
MAX_METADATA_BYTES = 256 << 20


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only its record classes, ``torch.Size`` and dtypes may be named in it."""

    def find_class(self, module: str, name: str) -> Any:
        known = (torch.dtype, torch.memory_format)
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), known)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which DCP's metadata does not hold")


def describe_dcp(path: str | os.PathLike[str], *, units: bool = False) -> list[str]:
    """``inspect`` of a DCP checkpoint: what its ``.metadata`` says (keys by section, dtypes, bytes), no tensor
    read; ``units``: every tensor's key, dtype and shape."""
    file = Path(path) / METADATA
    with open(file, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise ValueError(f"{file}: over {MAX_METADATA_BYTES} bytes, more than a DCP metadata file we read")
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
        entries = dict(meta.state_dict_metadata)
    except Exception as exc:  # noqa: BLE001 - any failure of a foreign file is the same finding
        raise ValueError(f"{file}: not DCP metadata this reader knows ({type(exc).__name__}: {exc})") from None
    tensors = {k: v for k, v in entries.items() if hasattr(v, "size") and hasattr(v, "properties")}
    sections = Counter(key.split(".", 1)[0] for key in entries)
    key = optimizer_key(entries)
    at = f"{key}.state."
    state = [k.split(".")[-1] for k in tensors if k.startswith(at)]
    params = {k.removeprefix(at).rsplit(".", 1)[0] for k in entries if k.startswith(at)}
    groups = {k.split(".")[2] for k in entries if k.startswith(f"{key}.param_groups.")}
    nbytes = sum(v.size.numel() * v.properties.dtype.itemsize for v in tensors.values())
    files = [p for p in Path(path).iterdir() if p.name != METADATA]
    out = [
        "format: PyTorch DCP checkpoint (torch.distributed.checkpoint; what its .metadata says, no tensor read)",
        f"keys: {len(entries)} ({', '.join(f'{s}: {n}' for s, n in sections.items()) or '-'}), {len(tensors)} tensors",
        f"model: {sum(1 for k in tensors if k.startswith('model.'))} tensors",
        f"optimizer: state of {len(params)} params, state keys {', '.join(dict.fromkeys(state)) or '-'}; "
        f"{len(groups)} param groups",
        f"optimizer key: {key if key in sections else '-'} (what the loading job's dcp.load dict must name it)",
        f"dtypes: {', '.join(sorted({_dtype(v) for v in tensors.values()})) or '-'}",
        f"tensor bytes: {nbytes}, files: {len(files)} data files, {sum(p.stat().st_size for p in files)} bytes",
    ]
    if units:
        out.append("key | dtype | shape")
        out += [f"{k} | {_dtype(v)} | {list(v.size)}" for k, v in tensors.items()]
    return out


def optimizer_key(entries: Mapping[str, Any]) -> str:
    """The top-level key an optimizer's state sits under in a DCP checkpoint's flattened keys (the one section with
    ``<key>.state.`` or ``<key>.param_groups.`` entries: ``"optimizer"`` as torchtitan and ``to_dcp`` write it,
    ``"optim"`` as older exports did, or any other); ``"optimizer"`` when none has."""
    found = [s for s in dict.fromkeys(k.split(".", 1)[0] for k in entries)
             if any(k.startswith((f"{s}.state.", f"{s}.param_groups.")) for k in entries)]  # fmt: skip
    return next((s for s in ("optimizer", "optim") if s in found), found[0] if found else "optimizer")


def _dtype(entry: Any) -> str:
    return str(entry.properties.dtype).removeprefix("torch.")
