"""What an opened input says about itself (``fsdp-optim inspect``'s lines): one function per kind of input, called by
its class in :mod:`fsdp_optim.offline.opened`; the same as one JSON object is :mod:`fsdp_optim.offline.report`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_optim.disk.text import escape, human_bytes
from fsdp_optim.offline import report as R

if TYPE_CHECKING:
    from fsdp_optim.formats.fairseq.shards import ShardSetReader
    from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors
    from fsdp_optim.formats.sharded.manifest import Manifest
    from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
    from fsdp_optim.formats.whole_file import WholeFile


def _step_text(steps: Sequence[Any]) -> str:
    """The report's distinct steps (numbers, then other values as text) as one line's text."""
    shown = [v if isinstance(v, str) else _number_text(v) for v in steps]
    if not shown:
        return "-"
    return shown[0] if len(shown) == 1 else f"{shown[0]}..{shown[-1]} ({len(shown)} distinct)"


def _number_text(v: int | float) -> str:
    text = str(v) if type(v) is int else repr(v)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _summary(s: Mapping[str, Any], fmt: str, *, units: bool = False) -> list[str]:
    """inspect's lines of the summary ``s`` that :mod:`fsdp_optim.offline.report` makes of a manifest (FSDP units,
    padding) or of a dict."""
    manifest = s.get("padding_elements") is not None
    keys = ", ".join(f"{k} ({v})" for k, v in s["state_keys"].items()) or "-"
    padding = f", padding elements: {s['padding_elements']}" if manifest else ""
    out = [
        f"format: {fmt}",
        f"optimizer: {s['optimizer'] or 'unknown'}",
        f"world size: {'unknown' if s['world_size'] is None else s['world_size']}",
        *([f"units: {len({u['unit'] for u in s['units']})} ({len(s['units'])} flat parameters)"] if manifest else []),
        f"params: {s['params']} ({s['params_with_state']} with state)",
        f"param groups: {s['param_groups']}",
        f"state keys: {keys}",
        f"step: {_step_text(s['steps'])}",
        f"state bytes: {human_bytes(s['state_bytes'])}{padding}",
    ]
    if s.get("files"):
        out.append(f"files: {s['files']['count']} rank files, {human_bytes(s['files']['bytes'])}")
    if units and manifest:
        out.append("unit | flat | params | numel | world size | padding per rank | dtype | state | param shapes")
        for u in s["units"]:
            shapes = ", ".join(f"{p['name']} {p['shape']}" for p in u["params"])
            out.append(
                f"{u['unit'] or '<root>'} | {u['flat']} | {len(u['params'])} | {u['numel']} | {u['world_size']} | "
                f"{u['padding']} | {u['dtype']} | {','.join(u['state']) or '-'} | {shapes}"
            )
    return out


def _scalar(value: object) -> object:
    import torch

    return value.item() if torch.is_tensor(value) and value.dim() == 0 else value


_NEEDS_LAYOUT = (
    "--layout PATH (a sharded checkpoint or layout file of the same model, wrapped the same way; see save_layout)"
)


def _full(obj: Mapping[str, Any], *, native: bool = False, what: str | None = None) -> list[str]:
    """A full dict's (or a fairscale-native dict's) summary; ``what``: its format line's, when another kind's."""
    from fsdp_optim.formats.fullstate import read_meta

    meta = read_meta(obj) or {}
    what = what or (
        "fairscale-native full dict (from fairscale's gather_full_optim_state_dict: parameters numbered in "
        "FSDP-instance order, without names)"
        if native
        else f"fsdp_optim full dict (version {meta.get('version')})"
        if meta
        else "full dict without fsdp_optim metadata (a plain optimizer's state_dict() with param_names)"
    )
    out = _summary(R.of_full({}, obj), what)
    if native:
        out.append(f"needs: {_NEEDS_LAYOUT} to convert, consolidate or reshard it; --optimizer NAME records its class")
    return out


def _model(m: Mapping[str, Any], what: str = "params", where: str = "") -> list[str]:
    """A whole checkpoint's model and buffers, from the report's ``model``."""
    tied = ", ".join(f"{a} -> {b}" for a, b in m["tied"])
    tied = f" + {len(m['tied'])} tied names ({tied})" if tied else ""
    return [
        f"model: {m['params']} {what}{tied}, weights "
        f"{human_bytes(m['weight_bytes'])} ({', '.join(m['weight_dtypes']) or '-'})",
        f"buffers: {len(m['buffers'])} ({', '.join(m['buffers']) or '-'}){where}",
    ]


def describe_training(ckpt: ShardedCheckpoint) -> list[str]:
    """A whole checkpoint's model, buffers and per-rank extra (its side files read: they are small)."""
    extras = R.side_extras(ckpt)
    m = R.model_of_checkpoint(ckpt, extras)
    where = "every rank's side file (they differed across ranks)" if m["buffers_per_rank"] else "rank 0's side file"
    out = [*_model(m, where=f" in {where}"),
           f"side files: {m['side_files']['count']}, {human_bytes(m['side_files']['bytes'])}"]  # fmt: skip
    by_keys: dict[str, list[int]] = {}
    for rank, extra in extras:
        shown = ", ".join(map(str, extra)) if isinstance(extra, Mapping) else type(extra).__name__
        by_keys.setdefault(shown or "-", []).append(rank)
    for shown, ranks in by_keys.items():
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks_text(ranks)}"
        out.append(f"extra of {which}: {shown}")
    return out


def describe_whole_file(whole: WholeFile) -> list[str]:
    """consolidate's file of a whole checkpoint: its optimizer as a full dict's summary, then the model and extra."""
    fmt = "format: consolidated whole checkpoint file ({'model', 'optimizer', 'extra'}; "
    if whole.optimizer is not None:
        out = [f"{fmt}optimizer: full dict)", *_full(whole.optimizer)[1:]]
        what = "params"
    else:
        out = [f"{fmt}saved without an optimizer)"]
        what = "tensors (params and buffers: no optimizer names them)"
    info = whole.summary()
    extra = info["extra_keys"]
    return [*out, *_model(info, what),
            f"extra: {', '.join(extra) or '-'}" if extra is not None else f"extra: a {info['extra_type']}"]  # fmt: skip


def _ranks_text(ranks: Sequence[int]) -> str:
    contiguous = list(ranks) == list(range(ranks[0], ranks[-1] + 1))
    return f"{ranks[0]}..{ranks[-1]}" if contiguous else ", ".join(map(str, ranks))


def describe_named(named: NamedSafetensors) -> list[str]:
    """A named safetensors file, from its checked header (no tensor is read but the 0-dim scalars)."""
    version = named.document.header.get("version")
    return _summary(R.of_named({}, named),
                    f"named safetensors file (<param name>/<state key> tensors; version {version})")  # fmt: skip


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
    rank0 = shards.rank0()
    manifest = shards.manifest
    what = f"fairseq/metaseq shard set ({shards.metadata_key}) (version {manifest.version})"
    out = _summary(R.of_manifest({}, manifest), what, units=units)
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
        from fsdp_optim.formats.sharded.verification import present_and_sized

        damaged = present_and_sized(path, manifest)  # the manifest read once
        if damaged:
            raise ValueError(f"{path}: damaged: {'; '.join(damaged)} (fsdp-optim verify {path} checks every byte)")
    what = "layout file" if layout else "sharded checkpoint"
    whole = checkpoint if checkpoint is not None and manifest.training is not None else None
    title = f"whole {what} (model, optimizer, extra)" if whole is not None else what
    out = _summary(R.of_manifest({}, manifest), f"{title} (version {manifest.version})", units=units)
    return out + describe_training(whole) if whole is not None else out


def describe_any_rank_file(path: str | os.PathLike[str], raw: Mapping[str, Any] | None) -> list[str]:
    """One rank file of a checkpoint (format 2 and 3: safetensors, its checked header only; format 1: a torch
    file)."""
    if raw is None:
        from fsdp_optim.disk.untrusted import open_regular
        from fsdp_optim.formats.sharded.safetensors_header import read_rank_header

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


def describe_loaded(
    path: str | os.PathLike[str], raw: Mapping[str, Any], *, native: bool = False, units: bool, named: bool = False
) -> list[str]:
    """A full dict, a fairscale-native dict or a name-keyed dict (``named``: ``convert --to named``'s, parameters by
    name), its skeleton checked before the summary walks it."""
    from fsdp_optim.disk.objects import check_state_dict

    check_state_dict(raw, str(path))
    if named:
        raw = {**raw, "param_names": {n: n for g in raw["param_groups"] for n in g["params"]}}
    what = "name-keyed dict (convert --to named: for FSDP2's set_optimizer_state_dict)" if named else None
    out = _full(raw, native=native, what=what)
    names = raw.get("param_names")
    if units and isinstance(names, Mapping):
        out += param_table({str(names.get(pid, pid)): e for pid, e in raw["state"].items()})
    return out
