"""What an opened input says about itself (``fsdp-optim inspect``'s lines): one function per kind of input, called by
its class in :mod:`fsdp_optim.offline.opened`; the same as one JSON object is :mod:`fsdp_optim.offline.report`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_optim.disk.text import escape, human_bytes

if TYPE_CHECKING:
    from fsdp_optim.formats.fairseq.shards import ShardSetReader
    from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors
    from fsdp_optim.formats.sharded.manifest import Manifest
    from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
    from fsdp_optim.formats.whole_file import WholeFile


def _step_text(steps: Sequence[Any]) -> str:
    if not steps:
        return "-"
    # Sorted as numbers (int and float compare exactly, none converted: a step of 10**400 has no float), NaN
    # and other kinds of value after them, as text.
    numbers = sorted({s for s in steps if type(s) in (int, float) and s == s})
    others = sorted({repr(s)[:40] for s in steps if not (type(s) in (int, float) and s == s)})
    shown = [_number_text(v) for v in numbers] + others
    return shown[0] if len(shown) == 1 else f"{shown[0]}..{shown[-1]} ({len(shown)} distinct)"


def _number_text(v: int | float) -> str:
    if type(v) is float and v.is_integer():
        return str(int(v))
    text = str(v) if type(v) is int else repr(v)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"



def _scalar(value: object) -> object:
    import torch

    return value.item() if torch.is_tensor(value) and value.dim() == 0 else value



def describe_manifest(manifest: Manifest, what: str, out: list[str], *, units: bool) -> None:
    from fsdp_optim.core.dtypes import dtype_to_str
    from fsdp_optim.core.flatten import StateKind

    if manifest.training is not None:  # a whole checkpoint: the optimizer's lines without the weights key
        from dataclasses import replace

        from fsdp_optim.formats.sharded.training import optimizer_flats

        manifest = replace(manifest, flat_params=optimizer_flats(manifest.flat_params))
    keys: dict[str, str | None] = {}  # a sharded entry of a checked manifest always names its dtype
    steps = []
    for flat in manifest.flat_params:
        for e in flat.state:
            keys.setdefault(e.key, e.dtype if e.kind is StateKind.SHARDED else "scalar")
            if e.key == "step":
                steps.append(_scalar(e.value))
    padding = sum(sum(f.padding()) for f in manifest.flat_params)
    with_state = sum(len(f.params) for f in manifest.flat_params if f.state)
    out += [
        f"format: {what} (version {manifest.version})",
        f"optimizer: {manifest.optimizer or 'unknown'}",
        f"world size: {manifest.world_size}",
        f"units: {len({f.unit for f in manifest.flat_params})} ({len(manifest.flat_params)} flat parameters)",
        f"params: {len(manifest.param_order)} ({with_state} with state)",
        f"param groups: {len(manifest.groups)}",
        f"state keys: {', '.join(f'{k} ({v})' for k, v in keys.items()) or '-'}",
        f"step: {_step_text(steps)}",
        f"state bytes: {human_bytes(manifest.state_bytes())}, padding elements: {padding}",
    ]
    if manifest.files:
        out.append(f"files: {len(manifest.files)} rank files, {human_bytes(sum(f.nbytes for f in manifest.files))}")
    if units:
        out.append("unit | flat | params | numel | world size | padding per rank | dtype | state | param shapes")
        for i, f in enumerate(manifest.flat_params):
            state = ",".join(e.key for e in f.state) or "-"
            shapes = ", ".join(f"{p.name} {list(p.shape)}" for p in f.params)
            out.append(
                f"{f.unit or '<root>'} | {i} | {len(f.params)} | {f.numel} | {f.world_size} | {f.padding()} | "
                f"{dtype_to_str(f.dtype)} | {state} | {shapes}"
            )



_NEEDS_LAYOUT = (
    "--layout PATH (a sharded checkpoint or layout file of the same model, wrapped the same way; see save_layout)"
)



def describe_full(obj: Mapping[str, Any], out: list[str], *, native: bool) -> None:
    import torch

    from fsdp_optim.formats.fullstate import read_meta

    meta = read_meta(obj) or {}
    keys: dict[str, str | None] = {}  # a sharded entry of a checked manifest always names its dtype
    steps = []
    nbytes = 0
    for entries in obj["state"].values():
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0:
                keys.setdefault(key, str(value.dtype).removeprefix("torch."))
                nbytes += value.numel() * value.element_size()
            else:
                keys.setdefault(key, "scalar")
                if key == "step":
                    steps.append(_scalar(value[0] if isinstance(value, list) else value))
    what = (
        "fairscale-native full dict (from fairscale's gather_full_optim_state_dict: parameters numbered in "
        "FSDP-instance order, without names)"
        if native
        else f"fsdp_optim full dict (version {meta.get('version')})"
        if meta
        else "full dict without fsdp_optim metadata (a plain optimizer's state_dict() with param_names)"
    )
    members = [p for g in obj["param_groups"] for p in g["params"]]
    n_params = len(obj.get("param_names") or obj.get("param_id_map") or members)
    out += [
        f"format: {what}",
        f"optimizer: {meta.get('optimizer') or 'unknown'}",
        f"world size: {meta.get('world_size', 'unknown')}",
        f"params: {n_params} ({len(obj['state'])} with state)",
        f"param groups: {len(obj['param_groups'])}",
        f"state keys: {', '.join(f'{k} ({v})' for k, v in keys.items()) or '-'}",
        f"step: {_step_text(steps)}",
        f"state bytes: {human_bytes(nbytes)}",
    ]
    if native:
        out.append(f"needs: {_NEEDS_LAYOUT} to convert, consolidate or reshard it; --optimizer NAME records its class")



def describe_training(ckpt: ShardedCheckpoint) -> list[str]:
    """A whole checkpoint's model, buffers and per-rank extra (its side files read: they are small)."""
    from fsdp_optim.core.dtypes import dtype_from_str
    from fsdp_optim.core.records import WEIGHTS_KEY
    from fsdp_optim.formats.sharded.side_file import read_side_file

    manifest, training = ckpt.manifest, ckpt.manifest.training
    if training is None:
        raise ValueError(f"{ckpt.directory}: asked for the model of an optimizer-only checkpoint")
    weights = [(f, e) for f in manifest.flat_params for e in f.state if e.key == WEIGHTS_KEY]
    nbytes = sum(f.numel * dtype_from_str(e.dtype, where="weights").itemsize for f, e in weights)
    dtypes = sorted({e.dtype for _, e in weights if e.dtype is not None})
    params = sum(len(f.params) for f, _ in weights)
    tied = ", ".join(f"{a} -> {b}" for a, b in training.aliases)
    where = "every rank's side file (they differed across ranks)" if training.buffers_per_rank else "rank 0's side file"
    buffers = ", ".join(b.name for b in training.buffers)
    out = [
        f"model: {params} params{f' + {len(training.aliases)} tied names ({tied})' if tied else ''}, weights "
        f"{human_bytes(nbytes)} ({', '.join(dtypes) or '-'})",
        f"buffers: {len(training.buffers)} ({buffers or '-'}) in {where}",
        f"side files: {len(training.files)}, {human_bytes(sum(f.nbytes for f in training.files))}",
    ]
    by_keys: dict[str, list[int]] = {}
    for record in training.files:
        _, extra = read_side_file(ckpt.directory, record)
        shown = ", ".join(map(str, extra)) if isinstance(extra, Mapping) else type(extra).__name__
        by_keys.setdefault(shown or "-", []).append(record.rank)
    for shown, ranks in by_keys.items():
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks_text(ranks)}"
        out.append(f"extra of {which}: {shown}")
    return out


def describe_whole_file(whole: WholeFile) -> list[str]:
    """consolidate's file of a whole checkpoint: its optimizer as a full dict's summary, then the model and extra."""
    out: list[str] = []
    if whole.optimizer is not None:
        describe_full(whole.optimizer, out, native=False)
        out[0] = "format: consolidated whole checkpoint file ({'model', 'optimizer', 'extra'}; optimizer: full dict)"
    else:
        out += ["format: consolidated whole checkpoint file ({'model', 'optimizer', 'extra'}; saved without an "
                "optimizer)"]  # fmt: skip
    info = whole.summary()
    tied = ", ".join(f"{a} -> {b}" for a, b in whole.aliases)
    what = "params" if whole.optimizer is not None else "tensors (params and buffers: no optimizer names them)"
    out += [
        f"model: {info['params']} {what}{f' + {len(whole.aliases)} tied names ({tied})' if tied else ''}, weights "
        f"{human_bytes(info['weight_bytes'])} ({', '.join(info['weight_dtypes']) or '-'})",
        f"buffers: {len(whole.buffers)} ({', '.join(whole.buffers) or '-'})",
        f"extra: {', '.join(info['extra_keys']) or '-'}" if info["extra_keys"] is not None else
        f"extra: a {info['extra_type']}",
    ]  # fmt: skip
    return out


def _ranks_text(ranks: Sequence[int]) -> str:
    contiguous = list(ranks) == list(range(ranks[0], ranks[-1] + 1))
    return f"{ranks[0]}..{ranks[-1]}" if contiguous else ", ".join(map(str, ranks))


def describe_named(named: NamedSafetensors) -> list[str]:
    """A named safetensors file, from its checked header (no tensor is read but the 0-dim scalars)."""
    doc = named.document
    keys: dict[str, str] = {}
    for entries in doc.state.values():
        for e in entries:
            info = named.tensors.get(e.tensor) if e.tensor is not None else None
            shown = "scalar" if e.kind == "scalar" or info is None else str(info.dtype).removeprefix("torch.")
            keys.setdefault(e.key, shown)
    steps = [_scalar(named.scalar(name, "step")) for name in doc.state if named.scalar(name, "step") is not None]
    return [
        f"format: named safetensors file (<param name>/<state key> tensors; version {doc.header.get('version')})",
        f"optimizer: {doc.optimizer or 'unknown'}",
        f"world size: {doc.header.get('world_size', 'unknown')}",
        f"params: {len(doc.param_order)} ({len(doc.state)} with state)",
        f"param groups: {len(doc.groups)}",
        f"state keys: {', '.join(f'{k} ({v})' for k, v in keys.items()) or '-'}",
        f"step: {_step_text(steps)}",
        f"state bytes: {human_bytes(sum(t.nbytes for t in named.tensors.values()))}",
    ]


def describe_named_dict(obj: Mapping[str, Any], *, units: bool) -> list[str]:
    """A name-keyed dict (``convert --to named``): the full dict's summary, parameters by name."""
    lines: list[str] = []
    describe_full({**obj, "param_names": {n: n for g in obj["param_groups"] for n in g["params"]}}, lines,
                  native=False)  # fmt: skip
    lines[0] = "format: name-keyed dict (convert --to named: for FSDP2's set_optimizer_state_dict)"
    if units:
        lines += param_table(obj["state"])
    return lines


def param_table(state: Mapping[Any, Mapping[str, Any]]) -> list[str]:
    """One line per parameter with state: its name, then each state key's dtype and shape."""
    import torch

    out = ["param | state (key dtype shape)"]
    for name, entries in state.items():
        shown = [f"{k} {str(v.dtype).removeprefix('torch.')} {list(v.shape)}" if torch.is_tensor(v) else f"{k} {v!r}"
                 for k, v in entries.items()]  # fmt: skip
        out.append(f"{name} | {', '.join(shown) or '-'}")
    return out


def describe_shards(shards: ShardSetReader, *, units: bool) -> list[str]:
    """A fairseq/metaseq shard set: its manifest's lines, then its files, extras, buffers and other keys."""
    out: list[str] = []
    rank0 = shards.rank0()
    describe_manifest(shards.manifest, f"fairseq/metaseq shard set ({shards.metadata_key})", out, units=units)
    size = sum(p.stat().st_size for p in shards.paths)
    out.insert(1, f"files: {len(shards.paths)} ({shards.label}), {human_bytes(size)}")
    recorded = " / ".join(n for n in shards.recorded_optimizer if n)
    if recorded:  # fairseq's own class: say which torch.optim class's state it keeps
        out[:] = [f"{line} (recorded: {recorded})" if line.startswith("optimizer: ") else line for line in out]
    extras = {k: _scalar(rank0["last_optimizer_state"][k]) for k in shards.extras}
    out.append(f"optimizer extras: {', '.join(f'{k}={v!r}' for k, v in extras.items()) or '-'}")
    unsaved = f"; not saved (non-persistent): {', '.join(shards.unsaved_buffers)}" if shards.unsaved_buffers else ""
    out.append(f"buffers: {', '.join(shards.buffers) or '-'}{unsaved}")
    kept = [k for k in rank0 if k not in ("model", "last_optimizer_state", shards.metadata_key)]
    out.append(f"other keys: {', '.join(kept) or '-'}")
    return out


def describe_sharded(
    path: str | os.PathLike[str], manifest: Manifest, checkpoint: ShardedCheckpoint | None, *, layout: bool, units: bool
) -> list[str]:
    """A sharded checkpoint (its files present and sized first: ``damaged`` otherwise) or a layout file; a whole
    checkpoint's model, buffers and extra after the optimizer's lines."""
    if not layout:
        from fsdp_optim.formats.sharded.steps import present_and_sized

        damaged = present_and_sized(path, manifest)  # the manifest read once
        if damaged:
            raise ValueError(f"{path}: damaged: {'; '.join(damaged)} (fsdp-optim verify {path} checks every byte)")
    out: list[str] = []
    what = "layout file" if layout else "sharded checkpoint"
    whole = checkpoint if checkpoint is not None and manifest.training is not None else None
    title = f"whole {what} (model, optimizer, extra)" if whole is not None else what
    describe_manifest(manifest, title, out, units=units)
    return out + describe_training(whole) if whole is not None else out


def describe_any_rank_file(path: str | os.PathLike[str], raw: Mapping[str, Any] | None) -> list[str]:
    """One rank file of a checkpoint (format 2 and 3: safetensors, its checked header only; format 1: a torch
    file)."""
    if raw is None:
        from fsdp_optim.disk.untrusted import open_regular
        from fsdp_optim.formats.sharded.rank_file import read_rank_header

        fd, st = open_regular(Path(path))
        try:
            meta, tensors = (h := read_rank_header(fd, st.st_size, str(path))).metadata, h.tensors
        finally:
            os.close(fd)
        if meta.get("format") != "fsdp_optim" or meta.get("kind") != "shard":
            raise ValueError(
                f"{path}: a safetensors file, but not an fsdp_optim rank file (its metadata: "
                f"{escape(repr(dict(meta)), limit=200)})"
            )
        return [
            f"format: one rank file of a sharded checkpoint (version {escape(meta.get('version', '?'), limit=20)}; "
            "inspect its directory for the whole)",
            f"rank: {escape(meta.get('rank', '?'), limit=20)} of {escape(meta.get('world_size', '?'), limit=20)}",
            "tensors: " + (", ".join(f"{name} [{numel}]" for name, (_, numel, _) in tensors.items()) or "-"),
        ]
    header = raw["fsdp_optim_checkpoint"]
    return [
        "format: one rank file of a sharded checkpoint (inspect its directory for the whole)",
        f"rank: {header.get('rank')} of {header.get('world_size')}",
        f"flat parameters with state: {len(raw.get('state', {}))}",
    ]


def describe_loaded(path: str | os.PathLike[str], raw: Mapping[str, Any], *, native: bool, units: bool) -> list[str]:
    """A full dict or a fairscale-native dict (its skeleton checked before the summary walks it)."""
    from fsdp_optim.disk.objects import check_state_dict

    check_state_dict(raw, str(path))
    out: list[str] = []
    describe_full(raw, out, native=native)
    names = raw.get("param_names")
    if units and isinstance(names, Mapping):
        out += param_table({str(names.get(pid, pid)): e for pid, e in raw["state"].items()})
    return out
