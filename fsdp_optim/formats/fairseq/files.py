"""fairseq / metaseq sharded checkpoints (``use_sharded_state``): what one rank file holds, and its checked
outline (:func:`summarise`); a set's file names are in :mod:`.paths`.

A *shard set* is one file per rank, ``{prefix}-shard{r}.pt`` (metaseq: ``checkpoint_18-model_part-0-shard0.pt``;
fairseq: ``checkpoint_last-shard0.pt``), each ``torch.save``-d by one rank of a fairscale FSDP job::

    {"model": local_state_dict(),   # {"block1.flat_param_0": Tensor[ceil(numel / N)], "frozen.weight": ..., buffers}
     "last_optimizer_state": {"state": {local id: {"exp_avg": Tensor[ceil(numel / N)], "step": tensor(7.)}},
                              "param_groups": [{"lr": ..., "params": [local ids]}],
                              "loss_scale": 128.0},                    # wrapper extras (fairseq's FP16Optimizer)
     "shard_metadata" | "fsdp_metadata": local_metadata_dict(),       # metaseq and fairseq nllb | fairseq main
     "cfg": {...}, "optimizer_history": [...], "extra_state": {...}, "task_state": {...}, ...}

``local_metadata_dict()`` lists the FSDP instances in ``named_modules()`` order::

    {"param_metadata": [{"fsdp_path": "block1", "no_broadcast_optim_state": False,
                         "shared_param_info": [("embed.weight", "head.weight")],
                         "params": {"flat_param_0": {"names": ["0.weight", "0.bias"],
                                                      "shapes": [Size([7, 6]), Size([7])],
                                                      "numels": [42, 7], "padding": 1}}}, ...],   # padding: this rank's
     "buffer_names": ["decoder.version", ...]}   # every buffer, non-persistent ones too (never in "model")

Each *backing parameter* (a flat parameter, or a parameter an instance left unflattened) becomes one source flat, in
the ``model`` dict's order (the wrapped model's ``parameters()`` order); which optimizer id is which is not recorded
(:func:`~fsdp_optim.formats.fairseq.checks.match_optimizer_ids`).

Loading (:func:`load_shard`): ``torch.load(weights_only=True, mmap=True)`` through the gate for foreign files.
fairseq and metaseq load their own files with ``weights_only=False``, because ``cfg`` may hold
``argparse.Namespace`` objects (and ``extra_state`` numpy scalars); those data-only classes, and only those, are
allowed (:data:`DATA_ONLY_GLOBALS`; the caller may name more with ``allow_globals``). No code from a file ever runs.
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.checksums import digest
from fsdp_optim.core.layout import ParamSpec, clean_path
from fsdp_optim.disk.untrusted import load_foreign
from fsdp_optim.formats.fairseq.optimizers import last_history, recorded_names

__all__ = ["DATA_ONLY_GLOBALS", "METADATA_KEYS", "OPTIM_KEY", "Backing", "RankSummary", "load_shard", "summarise"]

OPTIM_KEY = "last_optimizer_state"
METADATA_KEYS = ("shard_metadata", "fsdp_metadata")  # metaseq and fairseq nllb; fairseq main


def _data_only_globals() -> list[Any]:
    """Classes whose unpickling only builds plain data (no ``__setstate__`` or ``__reduce__`` code of theirs runs)."""
    allowed: list[Any] = [argparse.Namespace]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return allowed
    core = np._core if hasattr(np, "_core") else np.core  # type: ignore[attr-defined]  # numpy 2, numpy 1
    scalar = core.multiarray.scalar
    allowed += [(scalar, "numpy.core.multiarray.scalar"), (scalar, "numpy._core.multiarray.scalar"), np.dtype]
    allowed += [
        getattr(np.dtypes, name)
        for name in dir(getattr(np, "dtypes", None))
        if name.endswith("DType") and not name.startswith(("Object", "Void", "String", "StrDType"))
    ]
    return allowed


DATA_ONLY_GLOBALS = tuple(_data_only_globals())


def _resolve_global(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"allow_globals: cannot import '{name}' ({exc}); give 'module.Class' of an importable class"
        ) from exc


def load_shard(path: Path, *, allow_globals: Sequence[str] = ()) -> Any:
    """One rank file (see the module docstring); refuses a file that holds other classes, naming all of them."""
    allowed = [*DATA_ONLY_GLOBALS, *(_resolve_global(name) for name in allow_globals)]
    return load_foreign(path, allowed_globals=allowed, mmap=True)


@dataclass(frozen=True)
class Backing:
    """One backing parameter as the metadata describes it (``padding`` per rank filled in later)."""

    instance: int
    unit: str  # the instance's fsdp_path ("" for the root)
    name: str  # backing name inside the instance: "flat_param_0", or the parameter's own name
    key: str  # its key in the ``model`` dict
    params: tuple[ParamSpec, ...]  # unwrapped names, shapes, offsets

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def flattened(self) -> bool:
        return [p.name for p in self.params] != [_join(self.unit, self.name)]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


@dataclass(frozen=True)
class RankSummary:
    path: Path
    metadata_key: str
    backings: tuple[Backing, ...]
    padding: tuple[int, ...]  # per backing, as recorded
    structure: str  # digest of the metadata without padding
    buffers: tuple[str, ...]  # the buffers the file holds (persistent ones)
    unsaved_buffers: tuple[str, ...]  # listed in buffer_names but not saved: non-persistent buffers
    aliases: Mapping[str, str]  # unwrapped alias -> parameter name (shared_param_info)
    model: Mapping[str, tuple[tuple[int, ...], torch.dtype, tuple[int, int]]]  # key -> shape, dtype, storage identity
    groups: tuple[tuple[Mapping[str, Any], tuple[int, ...]], ...]
    state: Mapping[int, Mapping[str, Any]]  # id -> key -> (shape, dtype) or a scalar value
    extras: tuple[str, ...]  # optimizer keys besides state and param_groups
    extras_digest: str
    num_updates: Any
    optimizer: tuple[str | None, str | None]  # as recorded: class (optimizer_history), registered name (cfg)


def summarise(payload: Any, path: Path) -> RankSummary:
    """The checked outline of one rank file; raises ``ValueError`` naming the file and what is wrong."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"{path}: expected a fairseq/metaseq checkpoint dict, found {type(payload).__name__}")
    keys = [k for k in METADATA_KEYS if k in payload]
    missing = [k for k in ("model", OPTIM_KEY) if k not in payload]
    if missing or not keys:
        raise ValueError(
            f"{path}: expected a fairseq/metaseq shard file with 'model', '{OPTIM_KEY}' and 'shard_metadata' or "
            f"'fsdp_metadata' (saved with use_sharded_state); found keys {sorted(map(str, payload))}"
        )
    meta, model, optim = payload[keys[0]], payload["model"], payload[OPTIM_KEY]
    backings, padding, aliases = _backings(meta, path)
    if (
        not isinstance(optim, Mapping)
        or not isinstance(optim.get("state"), Mapping)
        or not isinstance(optim.get("param_groups"), (list, tuple))
    ):
        raise ValueError(f"{path}: '{OPTIM_KEY}' must be an optimizer state_dict with 'state' and 'param_groups'")
    groups = tuple(({k: v for k, v in g.items() if k != "params"}, tuple(g["params"])) for g in optim["param_groups"])
    state = {
        pid: {
            k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) and v.dim() > 0 else _own(v) for k, v in entries.items()
        }
        for pid, entries in optim["state"].items()
    }
    extras = tuple(k for k in optim if k not in ("state", "param_groups"))
    return RankSummary(
        path=path,
        metadata_key=keys[0],
        backings=backings,
        padding=padding,
        structure=digest([(b.unit, b.name, b.params) for b in backings] + [sorted(aliases.items())]),
        # fairscale lists every buffer (named_buffers()); the state dict holds only the persistent ones.
        buffers=tuple(n for n in meta.get("buffer_names", ()) if n in model),
        unsaved_buffers=tuple(n for n in meta.get("buffer_names", ()) if n not in model),
        aliases=aliases,
        model={
            k: (tuple(v.shape), v.dtype, (v.untyped_storage().data_ptr(), int(v.storage_offset())))
            for k, v in model.items()
            if torch.is_tensor(v)
        },
        groups=groups,
        state=state,
        extras=extras,
        extras_digest=digest({k: optim[k] for k in extras}),
        num_updates=last_history(payload).get("num_updates"),
        optimizer=recorded_names(payload),
    )


def _own(value: Any) -> Any:
    """A scalar state in memory of its own (a 0-dim tensor of a mapped file would keep the whole mapping)."""
    return value.clone() if torch.is_tensor(value) else value


def _backings(meta: Any, path: Path) -> tuple[tuple[Backing, ...], tuple[int, ...], dict[str, str]]:
    where = f"{path}: metadata"
    if not isinstance(meta, Mapping) or not isinstance(meta.get("param_metadata"), (list, tuple)):
        raise ValueError(f"{where} must be local_metadata_dict() output with a 'param_metadata' list")
    backings, padding, aliases = [], [], {}
    for i, inst in enumerate(meta["param_metadata"]):
        unit = clean_path(str(inst.get("fsdp_path", "")))
        if inst.get("no_broadcast_optim_state"):
            raise NotImplementedError(
                f"{where}: FSDP unit '{unit or '<root>'}' has no_broadcast_optim_state (rank-local expert "
                "parameters); its state differs per rank and cannot be resharded"
            )
        for src, dst in inst.get("shared_param_info", ()):
            aliases[clean_path(dst)] = clean_path(src)
        for name, info in inst.get("params", {}).items():
            names, shapes, numels = info.get("names"), info.get("shapes"), info.get("numels")
            if not (
                isinstance(names, (list, tuple)) and isinstance(shapes, (list, tuple)) and len(names) == len(shapes)
            ):
                raise ValueError(
                    f"{where}: unit '{unit or '<root>'}' param '{name}' needs 'names' and 'shapes' of one length"
                )
            specs, offset = [], 0
            for n, s, numel in zip(names, shapes, numels or [None] * len(names)):
                shape = tuple(int(d) for d in s)
                if numel is not None and numel != math.prod(shape):
                    raise ValueError(
                        f"{where}: parameter '{_join(unit, clean_path(n))}' has numel {numel} but shape {shape}"
                    )
                specs.append(ParamSpec(_join(unit, clean_path(n)), shape, offset))
                offset += math.prod(shape)
            backings.append(Backing(i, unit, clean_path(name), _join(unit, clean_path(name)), tuple(specs)))
            padding.append(int(info.get("padding", 0)))
    return tuple(backings), tuple(padding), aliases
