"""The file ``consolidate`` writes for a whole checkpoint, read back: one ``torch.save`` dict ::

    {"model": {"embed.weight": Tensor[11, 6], ..., "head.weight": <embed.weight's tensor>, "block1.seen": ...},
     "optimizer": <a full dict> or None (saved with optim=None),
     "extra": <saved rank 0's extra>}

The optimizer's ``param_names`` (or, inside a job, the model's layout) say which names are parameters; a name whose
tensor is a parameter's tensor is a tied name (read once), any other a buffer. Without either, every tensor that is
no alias counts as a weight. As planning sources, the weights are one more state key per parameter (``@param``), as
a whole sharded checkpoint keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.core.source import Source
from fsdp_optim.formats.fullstate import FORMAT_KEY, FORMAT_VERSION, full_dict_source
from fsdp_optim.formats.sharded.manifest import Manifest

__all__ = [
    "LAYOUT_KEY", "TIED_KEY", "WHOLE_KEYS", "WholeFile", "is_whole_file", "layout_record", "read_whole_safetensors",
    "recorded_layout",
]  # fmt: skip

WHOLE_KEYS = ("model", "optimizer", "extra")
LAYOUT_KEY = "layout"  # in a consolidated file's "fsdp_optim" block: the FSDP layout its checkpoint was saved with
TIED_KEY = "model"  # the top-level key whose values may name one tensor more than once (tied parameters)


def is_whole_file(obj: Any) -> bool:
    """Whether ``obj`` has the shape of consolidate's whole-checkpoint dict (exactly its three keys, a model dict)."""
    return isinstance(obj, Mapping) and set(obj) == set(WHOLE_KEYS) and isinstance(obj["model"], Mapping)


@dataclass(frozen=True)
class WholeFile:
    """A whole-checkpoint dict, its names told apart (see the module docstring)."""

    label: str
    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any] | None
    extra: Any
    params: tuple[str, ...]  # in the optimizer's (or the layout's) order
    aliases: tuple[tuple[str, str], ...]  # (tied name, the parameter's name)
    buffers: tuple[str, ...]

    @classmethod
    def of(cls, obj: Mapping[str, Any], label: str, *, params: Iterable[str] | None = None) -> WholeFile:
        """Check ``obj`` and tell its names apart; ``params``: the model's parameter names (a layout's), else the
        optimizer's. ``ValueError`` naming what is wrong."""
        model, optimizer = obj["model"], obj["optimizer"]
        for name, value in model.items():
            if not isinstance(name, str) or not torch.is_tensor(value):
                raise ValueError(
                    f"{label}['model'][{name!r}]: a {type(value).__name__}, expected a tensor under a string name"
                )
        if optimizer is not None and not isinstance(optimizer, Mapping):
            raise ValueError(f"{label}['optimizer']: a {type(optimizer).__name__}, expected a full dict or None")
        named = _optimizer_names(optimizer, label) if params is None else tuple(params)
        order = named if named is not None else _distinct(model)
        missing = [n for n in order if n not in model]
        if missing:
            raise ValueError(
                f"{label}: parameter(s) {', '.join(missing[:5])} have no tensor in its 'model' dict "
                f"({len(model)} names: {', '.join(list(model)[:5])}...)"
            )
        owner = {id(model[n]): n for n in reversed(order)}
        rest = [n for n in model if n not in set(order)]
        aliases = tuple((n, owner[id(model[n])]) for n in rest if id(model[n]) in owner)
        tied = {a for a, _ in aliases}
        buffers = tuple(n for n in rest if n not in tied)
        return cls(label, model, optimizer, obj["extra"], tuple(order), aliases, buffers)

    def source(self) -> Source | None:
        """The optimizer state alone (``None`` when saved with ``optim=None``)."""
        return None if self.optimizer is None else full_dict_source(self.optimizer, label=f"{self.label}['optimizer']")

    def whole_source(self) -> Source:
        """The weights (``@param``) beside the optimizer state, in its groups; the weights alone without one."""
        if self.optimizer is None:
            return self.weights_source()
        names = self.optimizer["param_names"]
        state = self.optimizer["state"]
        full = {
            **self.optimizer,
            "state": {pid: {**state.get(pid, {}), WEIGHTS_KEY: self.model[name]} for pid, name in names.items()},
        }
        return full_dict_source(full, label=self.label)

    def weights_source(self) -> Source:
        """The model weights as one state key per parameter (``@param``), in one group."""
        full = {
            "state": {i: {WEIGHTS_KEY: self.model[name]} for i, name in enumerate(self.params)},
            "param_groups": [{"params": list(range(len(self.params)))}],
            "param_names": dict(enumerate(self.params)),
            FORMAT_KEY: {"version": FORMAT_VERSION, "optimizer": "model weights", "world_size": None,
                         "scalar_keys": []},  # fmt: skip
        }
        return full_dict_source(full, label=f"{self.label}['model']")

    def buffer_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.model[name] for name in self.buffers}

    def summary(self) -> dict[str, Any]:
        """What the model holds, for ``inspect``: parameters, tied names, buffers, bytes and dtypes, extra's keys."""
        weights = [self.model[n] for n in self.params]
        return {
            "params": len(self.params),
            "tied": [list(pair) for pair in self.aliases],
            "weight_bytes": sum(t.numel() * t.element_size() for t in weights),
            "weight_dtypes": sorted({dtype_to_str(t.dtype) for t in weights}),
            "buffers": list(self.buffers),
            "extra_keys": [str(k) for k in self.extra] if isinstance(self.extra, Mapping) else None,
            "extra_type": type(self.extra).__name__,
            "has_optimizer": self.optimizer is not None,
        }


def read_whole_safetensors(path: Any) -> dict[str, Any]:
    """consolidate's one safetensors file of a whole checkpoint read back as its ``.pt`` twin holds it (see
    :meth:`~fsdp_optim.formats.named_safetensors.reader.NamedSafetensors.whole_dict`), every checksum checked;
    ``ValueError`` for a named safetensors file of optimizer state alone."""
    from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors

    with NamedSafetensors(path) as named:
        content = named.whole_dict()
    if content is None:
        raise ValueError(
            f"{path}: a named safetensors file of optimizer state alone (no model: consolidate of an optimizer-only "
            "checkpoint, or convert --to safetensors); expected a whole checkpoint (save_checkpoint's directory, or "
            "the file consolidate writes of one, .pt or .safetensors); load optimizer state with "
            "fsdp_optim.load_full_state"
        )
    return content


def layout_record(layout: ModelLayout) -> dict[str, Any]:
    """``layout`` as a consolidated file keeps it in its full dict's ``"fsdp_optim"`` block (under ``"layout"``): a
    layout file's manifest (no state, no files), which ``reshard`` of the file cuts for without ``--layout``."""
    return Manifest.from_layout(layout, save_id=LAYOUT_KEY).to_dict()


def recorded_layout(meta: Mapping[str, Any] | None, where: str) -> ModelLayout | None:
    """The layout a full dict's ``"fsdp_optim"`` block ``meta`` records (:func:`layout_record`), checked as a
    manifest is; ``None`` when it records none (a file written before, a dict gathered in a job)."""
    record = None if meta is None else meta.get(LAYOUT_KEY)
    if record is None:
        return None
    return Manifest.from_dict(record, source=f"{where}: the recorded '{LAYOUT_KEY}'").layout(0)


def _optimizer_names(optimizer: Mapping[str, Any] | None, label: str) -> tuple[str, ...] | None:
    if optimizer is None:
        return None
    names = optimizer.get("param_names")
    if not isinstance(names, Mapping) or not all(isinstance(n, str) for n in names.values()):
        raise ValueError(f"{label}['optimizer']: expected a full dict with 'param_names' (id -> parameter name)")
    return tuple(names.values())


def _distinct(model: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Every name of ``model`` but the later names of one tensor (aliases)."""
    seen: set[int] = set()
    out = []
    for name, value in model.items():
        if id(value) not in seen:
            seen.add(id(value))
            out.append(name)
    return tuple(out)
