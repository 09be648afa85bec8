"""fairseq / metaseq sharded checkpoints (``use_sharded_state``): the file format, finding and loading a set,
each file's checked outline, and which optimizer id is which parameter. Pure apart from reading files.

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

Each *backing parameter* (a flat parameter, or a parameter an instance left unflattened) becomes one source flat in
:mod:`fsdp_optim.fairseq`, in the order the files store them (the ``model`` dict's order, which is the wrapped model's
``parameters()`` order). The files do not say which optimizer id is which backing parameter;
:func:`~fsdp_optim.formats.fairseq.checks.match_optimizer_ids` finds the one assignment in which every param group
lists its parameters in that order and every state tensor has its parameter's shard size, and refuses when none or
several fit (``optimizer_keys`` then names them).

Loading: every file is read with ``torch.load(weights_only=True, mmap=True)``; fairseq and metaseq load
their own files with ``weights_only=False``, because ``cfg`` may hold ``argparse.Namespace`` objects (and
``extra_state`` numpy scalars). Those data-only classes, and only those, are allowed
(:data:`DATA_ONLY_GLOBALS`); anything else in a file is refused naming the classes, and the caller may
allow named classes it trusts (``allow_globals``). Nothing from a file is ever executed.

Memory: files are memory-mapped and read one unit range at a time; the mappings are dropped whenever the
bytes touched exceed ``max_mapped_bytes``. Checking a set maps one file at a time.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.checksums import digest
from fsdp_optim.core.layout import ParamSpec, clean_path
from fsdp_optim.core.limits import MAX_WORLD_SIZE
from fsdp_optim.disk.staged import Survey
from fsdp_optim.disk.untrusted import load_foreign
from fsdp_optim.formats.fairseq.optimizers import recorded_names

__all__ = [
    "DATA_ONLY_GLOBALS",
    "METADATA_KEYS",
    "OPTIM_KEY",
    "Backing",
    "RankSummary",
    "is_shard_set",
    "load_shard",
    "shard_paths",
    "shard_siblings",
    "summarise",
]

OPTIM_KEY = "last_optimizer_state"
METADATA_KEYS = ("shard_metadata", "fsdp_metadata")  # metaseq and fairseq nllb; fairseq main
_SHARD_FILE = re.compile(r"^(?P<prefix>.+)-shard(?P<rank>\d+)\.pt$")


# ---------------------------------------------------------------------------------------------------
# Paths


def _prefix(path: Path) -> Path:
    match = _SHARD_FILE.match(path.name)
    if match:
        return path.with_name(match["prefix"])
    return (
        path.with_suffix("") if path.suffix == ".pt" else path
    )  # "checkpoint_last.pt" names "checkpoint_last-shard*.pt"


def shard_siblings(prefix: Path) -> dict[int, list[Path]]:
    """Files ``{prefix.name}-shard<r>.pt`` beside ``prefix``, by rank."""
    found: dict[int, list[Path]] = {}
    if prefix.parent.is_dir():
        for entry in prefix.parent.iterdir():
            match = _SHARD_FILE.match(entry.name)
            if match and match["prefix"] == prefix.name and entry.is_file():
                found.setdefault(int(match["rank"]), []).append(entry)
    return found


@dataclass(frozen=True)
class SetClaims:
    """What an output directory of a shard set named ``name`` owns (for :mod:`fsdp_optim.disk.staged`): its
    ``{name}-shard<r>.pt`` files. Other files (a fairseq checkpoint directory holds many) are never foreign, and
    never touched; an existing set of the same name is replaced only with ``overwrite``."""

    name: str

    def survey(self, directory: Path) -> Survey:
        existing = shard_siblings(directory / self.name)
        names = frozenset(p.name for files in existing.values() for p in files)
        problem = f"already holds {self.name}-shard<r>.pt files (ranks {sorted(existing)})" if existing else None
        known = frozenset(os.listdir(directory))
        return Survey(replaces=names, known=known, problem=problem, overwrite_means="replace them")

    def created(self, entry: Mapping[str, Any]) -> set[str]:
        world_size = entry.get("world_size")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or not 0 < world_size <= MAX_WORLD_SIZE:
            return set()
        return {f"{self.name}-shard{r}.pt" for r in range(world_size)}

    def tagged(self, entry: Mapping[str, Any]) -> set[tuple[str, str]]:  # noqa: ARG002
        return set()

    def referenced(self, directory: Path) -> set[str]:
        # No manifest says which set is current: whatever is there is kept, so a recovery never deletes a set.
        return set(os.listdir(directory))

    def deletable(self, name: str) -> bool:
        match = _SHARD_FILE.match(name)
        return match is not None and match["prefix"] == self.name


def is_shard_set(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a fairseq/metaseq shard set: a file named ``*-shard<r>.pt``, or a path that is no
    file or directory itself but the prefix of such files. Judged by names; :func:`shard_paths` checks more."""
    path = Path(path)
    if path.is_dir():
        return False
    if _SHARD_FILE.match(path.name):
        return True
    return not path.exists() and bool(shard_siblings(_prefix(path)))


def shard_paths(path: str | os.PathLike[str]) -> tuple[Path, list[Path]]:
    """The set's prefix and its files in rank order. Raises naming the first missing or doubled file."""
    prefix = _prefix(Path(path))
    found = shard_siblings(prefix)
    if not found:
        raise FileNotFoundError(f"{path}: no shard files {prefix.name}-shard<N>.pt in {prefix.parent}")
    doubled = next((files for files in found.values() if len(files) > 1), None)
    if doubled:
        raise ValueError(f"{doubled[1]}: names the same rank as {doubled[0]}; a shard set has one file per rank")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise ValueError(
            f"{prefix.parent / f'{prefix.name}-shard{missing[0]}.pt'}: missing from the shard set (found shards "
            f"{sorted(found)}); a set holds one file per rank 0..N-1"
        )
    return prefix, [found[r][0] for r in range(len(found))]


# ---------------------------------------------------------------------------------------------------
# Loading without running code from the file


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


def load_shard(path: Path, *, allow_globals: Sequence[str] = (), mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True, mmap=...)`` through the gate for foreign files
    (:func:`~fsdp_optim.disk.untrusted.load_foreign`) with :data:`DATA_ONLY_GLOBALS` (and ``allow_globals``)
    allowed. Refuses a file that holds other classes, naming all of them."""
    allowed = [*DATA_ONLY_GLOBALS, *(_resolve_global(name) for name in allow_globals)]
    return load_foreign(path, allowed_globals=allowed, mmap=mmap)


# ---------------------------------------------------------------------------------------------------
# One rank file, summarised (shapes and scalars only: no page of a tensor is touched)


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
    history = payload.get("optimizer_history")
    num_updates = (
        history[-1].get("num_updates")
        if isinstance(history, list) and history and isinstance(history[-1], Mapping)
        else None
    )
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
        num_updates=num_updates,
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
