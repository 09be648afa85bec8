"""What an opened input says about itself as one JSON object (``fsdp-optim inspect --json``): one schema for every
input kind (documented in docs/cli.md).

Numbers are JSON numbers, keys are stable snake_case, a value the input does not record is ``null``::

    {"schema": 1, "path": "ckpt", "kind": "sharded_checkpoint", "format": "sharded checkpoint (version 3)",
     "version": 3, "optimizer": "Adam", "world_size": 2, "params": 18, "params_with_state": 16,
     "param_groups": 2, "state_keys": {"step": "scalar", "exp_avg": "float32"}, "steps": [3],
     "state_bytes": 2392, "padding_elements": 3, "files": {"count": 2, "bytes": 4416},
     "units": [{"unit": "block2", "flat": 0, "numel": 65, "world_size": 2, "padding": [0, 1], "dtype": "float32",
                "state": ["exp_avg", "exp_avg_sq", "step"],
                "params": [{"name": "block2.proj.weight", "shape": [5, 6]}, ...]}],
     "model": null, "details": {}}

``units`` lists FSDP units where the input has them (a checkpoint, a layout file, a shard set), else one entry per
parameter (``unit`` null); ``model`` describes a whole checkpoint's weights, buffers and extra; ``details`` holds
what only one kind records (a rank file's rank, a DCP directory's counts).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_optim.formats.kinds import Kind
    from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors
    from fsdp_optim.formats.sharded.manifest import Manifest
    from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
    from fsdp_optim.formats.whole_file import WholeFile

SCHEMA = 1
_INT = re.compile(r"^-?\d+$")


def base(path: str | os.PathLike[str], kind: Kind, lines: Sequence[str]) -> dict[str, Any]:
    """The members every kind has, ``null`` or empty until a kind fills them."""
    fmt = next((line.partition(": ")[2] for line in lines if line.startswith("format: ")), None)
    return {
        "schema": SCHEMA, "path": str(path), "kind": kind.name.lower(), "format": fmt,
        "version": None, "optimizer": None, "world_size": None, "params": None, "params_with_state": None,
        "param_groups": None, "state_keys": {}, "steps": [], "state_bytes": None, "padding_elements": None,
        "files": None, "units": [], "model": None, "details": {},
    }  # fmt: skip


def of_manifest(out: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
    """A sharded checkpoint's, a layout file's or a shard set's manifest (a whole checkpoint's weights left out)."""
    from dataclasses import replace

    from fsdp_optim.core.dtypes import dtype_to_str
    from fsdp_optim.core.flatten import StateKind
    from fsdp_optim.formats.sharded.training import optimizer_flats

    if manifest.training is not None:
        manifest = replace(manifest, flat_params=optimizer_flats(manifest.flat_params))
    flats = manifest.flat_params
    keys: dict[str, str] = {}
    steps = []
    for flat in flats:
        for e in flat.state:
            keys.setdefault(e.key, str(e.dtype) if e.kind is StateKind.SHARDED else "scalar")
            if e.key == "step":
                steps.append(e.value)
    out.update(
        version=manifest.version, optimizer=manifest.optimizer, world_size=manifest.world_size,
        params=len(manifest.param_order), params_with_state=sum(len(f.params) for f in flats if f.state),
        param_groups=len(manifest.groups), state_keys=keys, steps=_steps(steps), state_bytes=manifest.state_bytes(),
        padding_elements=sum(sum(f.padding()) for f in flats),
    )  # fmt: skip
    if manifest.files:
        out["files"] = {"count": len(manifest.files), "bytes": sum(f.nbytes for f in manifest.files)}
    out["units"] = [
        {"unit": f.unit, "flat": i, "numel": f.numel, "world_size": f.world_size, "padding": list(f.padding()),
         "dtype": dtype_to_str(f.dtype), "state": [e.key for e in f.state],
         "params": [{"name": p.name, "shape": list(p.shape)} for p in f.params]}
        for i, f in enumerate(flats)
    ]  # fmt: skip
    return out


def of_full(out: dict[str, Any], obj: Mapping[str, Any]) -> dict[str, Any]:
    """A full dict, a fairscale-native dict or a name-keyed dict: one entry per parameter with state."""
    import torch

    from fsdp_optim.formats.fullstate import read_meta

    meta = read_meta(obj) or {}
    names = obj.get("param_names") or {}
    keys: dict[str, str] = {}
    steps: list[Any] = []
    nbytes = 0
    units: list[dict[str, Any]] = []
    for pid, entries in obj["state"].items():
        shapes = {}
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0:
                keys.setdefault(key, str(value.dtype).removeprefix("torch."))
                nbytes += value.numel() * value.element_size()
                shapes[key] = list(value.shape)
            else:
                keys.setdefault(key, "scalar")
                if key == "step":
                    steps.append(value[0] if isinstance(value, list) else value)
        shape = next(iter(shapes.values()), None)
        name = str(names.get(pid, pid)) if isinstance(names, Mapping) else str(pid)
        units.append(_unit(len(units), name, shape, list(entries), dtypes=[keys[k] for k in entries]))
    members = [p for g in obj["param_groups"] for p in g["params"]]
    out.update(
        version=meta.get("version"), optimizer=meta.get("optimizer"), world_size=meta.get("world_size"),
        params=len(obj.get("param_names") or obj.get("param_id_map") or members), params_with_state=len(obj["state"]),
        param_groups=len(obj["param_groups"]), state_keys=keys, steps=_steps(steps), state_bytes=nbytes, units=units,
    )  # fmt: skip
    return out


def of_named(out: dict[str, Any], named: NamedSafetensors) -> dict[str, Any]:
    """A named safetensors file, from its checked header."""
    doc = named.document
    keys: dict[str, str] = {}
    units: list[dict[str, Any]] = []
    for name, entries in doc.state.items():
        shape = None
        for e in entries:
            info = named.tensors.get(e.tensor) if e.tensor is not None else None
            keys.setdefault(e.key, "scalar" if e.kind == "scalar" or info is None else str(info.dtype).removeprefix(
                "torch."))  # fmt: skip
            if info is not None and shape is None and e.kind != "scalar":
                shape = list(info.shape)
        units.append(_unit(len(units), name, shape, [e.key for e in entries], dtypes=[keys[e.key] for e in entries]))
    steps = [named.scalar(name, "step") for name in doc.state if named.scalar(name, "step") is not None]
    out.update(
        version=doc.header.get("version"), optimizer=doc.optimizer, world_size=doc.header.get("world_size"),
        params=len(doc.param_order), params_with_state=len(doc.state), param_groups=len(doc.groups), state_keys=keys,
        steps=_steps(steps), state_bytes=sum(t.nbytes for t in named.tensors.values()), units=units,
    )  # fmt: skip
    return out


def of_whole_file(out: dict[str, Any], whole: WholeFile) -> dict[str, Any]:
    """consolidate's file of a whole checkpoint: its optimizer as a full dict, then its model and extra."""
    if whole.optimizer is not None:
        of_full(out, whole.optimizer)
    info = whole.summary()
    out["model"] = _model(**{k: v for k, v in info.items() if k != "extra_type"}, buffers_per_rank=False)
    return out


def side_extras(ckpt: ShardedCheckpoint) -> list[tuple[int, Any]]:
    """``(saved rank, its extra)`` of every side file of a whole checkpoint (they are small)."""
    from fsdp_optim.formats.sharded.side_file import read_side_file

    training = ckpt.manifest.training
    return [(r.rank, read_side_file(ckpt.directory, r)[1]) for r in (training.files if training is not None else ())]


def model_of_checkpoint(ckpt: ShardedCheckpoint, extras: Sequence[tuple[int, Any]]) -> dict[str, Any]:
    """A whole sharded checkpoint's model: parameters, tied names, weight bytes and dtypes, buffers, side files, and
    every key any rank's ``extra`` (``extras``: :func:`side_extras`) holds, in the order first seen (``None`` when
    none is a dict)."""
    from fsdp_optim.core.dtypes import dtype_from_str
    from fsdp_optim.core.records import WEIGHTS_KEY

    manifest, training = ckpt.manifest, ckpt.manifest.training
    if training is None:
        raise ValueError(f"{ckpt.directory}: asked for the model of an optimizer-only checkpoint")
    weights = [(f, e) for f in manifest.flat_params for e in f.state if e.key == WEIGHTS_KEY]
    mapped = [extra for _, extra in extras if isinstance(extra, Mapping)]
    return _model(
        params=sum(len(f.params) for f, _ in weights),
        tied=[list(pair) for pair in training.aliases],
        weight_bytes=sum(f.numel * dtype_from_str(e.dtype, where="weights").itemsize for f, e in weights),
        weight_dtypes=sorted({e.dtype for _, e in weights if e.dtype is not None}),
        buffers=[b.name for b in training.buffers],
        buffers_per_rank=training.buffers_per_rank,
        side_files={"count": len(training.files), "bytes": sum(f.nbytes for f in training.files)},
        extra_keys=list(dict.fromkeys(str(k) for extra in mapped for k in extra)) if mapped else None,
        has_optimizer=manifest.optimizer is not None,
    )


def _unit(i: int, name: str, shape: list[int] | None, state: list[str], *, dtypes: list[str]) -> dict[str, Any]:
    """One parameter of an input without FSDP units, in the members of a unit (what it does not record: null)."""
    numel = None if shape is None else math.prod(shape)
    dtype = next((d for d in dtypes if d != "scalar"), None)
    return {"unit": None, "flat": i, "numel": numel, "world_size": None, "padding": None, "dtype": dtype,
            "state": state, "params": [{"name": name, "shape": shape}]}  # fmt: skip


def _model(**given: object) -> dict[str, Any]:
    """A whole checkpoint's model, in the same members whatever holds it (what it does not record: null)."""
    keys = ("params", "tied", "weight_bytes", "weight_dtypes", "buffers", "buffers_per_rank", "side_files",
            "extra_keys", "has_optimizer")  # fmt: skip
    return {key: given.get(key) for key in keys}


def of_rank_file(out: dict[str, Any], lines: Sequence[str], raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """One rank file: its rank and world size as numbers (``details``; a format-1 file: its state entries too)."""
    found = next((re.match(r"rank: (\S+) of (\S+)$", line) for line in lines if line.startswith("rank: ")), None)
    rank, world = (found.group(1), found.group(2)) if found else (None, None)
    header = raw.get("fsdp_optim_checkpoint") if isinstance(raw, Mapping) else None
    out["details"] = {"rank": _int(rank), "world_size": _int(world),
                      "state_entries": len(raw.get("state", {})) if raw is not None and isinstance(header, Mapping)
                      else None}  # fmt: skip
    out["world_size"] = out["details"]["world_size"]
    return out


def of_dcp(out: dict[str, Any], lines: Sequence[str]) -> dict[str, Any]:
    """A DCP directory, what its ``.metadata`` says: counts and bytes as numbers (``details``)."""
    text = "\n".join(lines)
    patterns = {
        "keys": r"^keys: (\d+)", "tensors": r"^keys: .*, (\d+) tensors$", "model_tensors": r"^model: (\d+) tensors",
        "optimizer_params": r"^optimizer: state of (\d+) params", "param_groups": r"; (\d+) param groups$",
        "tensor_bytes": r"^tensor bytes: (\d+)", "data_files": r"files: (\d+) data files",
        "file_bytes": r"data files, (\d+) bytes",
    }  # fmt: skip
    out["details"] = {k: _int(m.group(1)) if (m := re.search(p, text, re.MULTILINE)) else None
                      for k, p in patterns.items()}  # fmt: skip
    key = re.search(r"^optimizer key: (\S+) ", text, re.MULTILINE)
    out["details"]["optimizer_key"] = key.group(1) if key and key.group(1) != "-" else None
    out["param_groups"] = out["details"]["param_groups"]
    out["state_bytes"] = out["details"]["tensor_bytes"]
    return out


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and _INT.match(text) else None


def _steps(steps: Sequence[Any]) -> list[Any]:
    """The distinct steps as JSON numbers (tensors read), in order; a value of another kind as its text."""
    import torch

    values = [v.item() if torch.is_tensor(v) and v.dim() == 0 else v for v in steps]
    numbers = sorted({v for v in values if type(v) in (int, float) and v == v})
    others = sorted({repr(v)[:40] for v in values if not (type(v) in (int, float) and v == v)})
    return [int(v) if type(v) is float and v.is_integer() else v for v in numbers] + others
