"""``fsdp-optim``: inspect, consolidate, reshard and convert optimizer checkpoints, with no process group.

    fsdp-optim inspect PATH [--units]
    fsdp-optim consolidate SRC -o FILE [--layout PATH] [--optimizer NAME] [--no-model]
    fsdp-optim reshard SRC --world-size M -o DIR [--layout PATH] [--optimizer NAME]
    fsdp-optim convert SRC -o FILE|DIR [--layout PATH] [--optimizer NAME] [--to full|named|dcp|safetensors]
    fsdp-optim verify PATH

Sources: a sharded checkpoint directory of ours, a full dict file, a fairscale-native dict file, and a
fairseq/metaseq shard set (``use_sharded_state``: any ``*-shard<r>.pt`` file of the set, or the path before
``-shard``; ``--allow-global module.Class`` allows a class its ``cfg`` holds, see :mod:`fsdp_optim.fairseq_format`).
A shard set is consolidated into one fairseq-shaped checkpoint (every key kept, ``last_optimizer_state`` our
full dict, ``model`` the full weights unless ``--no-model``, as fairseq's own consolidation keeps them) and
resharded into shard files of the same format. ``verify`` checks every file of a checkpoint or shard set
(present, of its size, checksums matching) and exits 1 naming each damaged file.

A fairscale-native dict (from fairscale's own ``gather_full_optim_state_dict``) names no parameters, so
every verb but ``inspect`` needs ``--layout`` for it and converts it with :func:`~fsdp_optim.from_fairscale`.

Exit codes: 0 done; 1 bad input (one line on stderr: ``fsdp-optim: error: ...``); 2 bad usage (argparse);
70 an internal error (with its traceback). Every file is read with ``torch.load(..., weights_only=True)``.
Progress bars appear on a terminal only.

A dispatcher: torch and the package's modules are imported by the verb that needs them, so ``--help``
and argument errors cost no more than starting Python, and no verb imports fairscale or the collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_optim.formats.sharded.manifest import Manifest

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 70
# API parameter names as the command line spells them, for the "name: ..." prefix of an error.
_FLAGS = {
    "world_size": "--world-size",
    "layout": "--layout",
    "out_dir": "-o/--output",
    "param_order": "--layout",
    "allow_globals": "--allow-global",
    "optimizer": "--optimizer",
}


@contextlib.contextmanager
def _progress(desc: str) -> Iterator[Callable[[], None] | None]:
    """A per-unit callback drawing a ``tqdm`` bar on a terminal (``None`` elsewhere)."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc=desc, unit="unit", leave=False) as bar:
        yield lambda: bar.update()


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit} ({n} B)"
        value /= 1024
    raise AssertionError("unreachable")


def _step_text(steps: Sequence[Any]) -> str:
    if not steps:
        return "-"
    values = sorted({float(s) for s in steps})
    shown = [str(int(v)) if v.is_integer() else repr(v) for v in values]
    return shown[0] if len(shown) == 1 else f"{shown[0]}..{shown[-1]} ({len(shown)} distinct)"


def _scalar(value: Any) -> Any:
    import torch

    return value.item() if torch.is_tensor(value) and value.dim() == 0 else value


# ---------------------------------------------------------------------------------------------------
# inspect


def _inspect_manifest(manifest: Manifest, what: str, out: list[str], *, units: bool) -> None:
    from fsdp_optim.core.dtypes import dtype_to_str
    from fsdp_optim.core.flatten import StateKind

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
        out.append("unit | flat | params | numel | world size | padding per rank | dtype | state")
        for i, f in enumerate(manifest.flat_params):
            state = ",".join(e.key for e in f.state) or "-"
            out.append(
                f"{f.unit or '<root>'} | {i} | {len(f.params)} | {f.numel} | {f.world_size} | {f.padding()} | "
                f"{dtype_to_str(f.dtype)} | {state}"
            )


_NEEDS_LAYOUT = (
    "--layout PATH (a sharded checkpoint or layout file of the same model, wrapped the same way; see save_layout)"
)


def _inspect_full(obj: Mapping[str, Any], out: list[str]) -> None:
    import torch

    from fsdp_optim.formats.fairscale import is_fairscale_native
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
    native = is_fairscale_native(obj)
    what = (
        "fairscale-native full dict (from fairscale's gather_full_optim_state_dict: parameters numbered in "
        "FSDP-instance order, without names)"
        if native
        else f"fsdp_optim full dict (version {meta.get('version')})" if meta else "plain optimizer state dict"
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


def _inspect(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.offline.sources import Kind, open_source

    path = Path(args.path)
    out = [f"path: {path}"]
    with open_source(path, allow_globals=args.allow_global, describe_only=True) as opened:
        if opened.kind is Kind.SHARD_SET:
            _inspect_shards(opened, args, out)
        elif opened.manifest is not None:
            if opened.kind is Kind.SHARDED:
                from fsdp_optim.offline.verify import present_and_sized

                damaged = present_and_sized(path)
                if damaged:
                    raise ValueError(
                        f"{path}: damaged: {'; '.join(damaged)} (fsdp-optim verify {path} checks every byte)"
                    )
            what = "layout file" if opened.kind is Kind.LAYOUT else "sharded checkpoint"
            _inspect_manifest(opened.manifest, what, out, units=args.units)
        elif opened.named is not None:
            out += _inspect_named(opened.named)
        elif opened.kind is Kind.RANK_FILE and opened.raw is None:  # format 2: a safetensors rank file
            from fsdp_optim.formats.sharded.rank_file import describe_rank_file

            out += describe_rank_file(path)
        elif opened.kind is Kind.RANK_FILE:
            header = opened.raw["fsdp_optim_checkpoint"]
            out += [
                "format: one rank file of a sharded checkpoint (inspect its directory for the whole)",
                f"rank: {header.get('rank')} of {header.get('world_size')}",
                f"flat parameters with state: {len(opened.raw.get('state', {}))}",
            ]
        else:
            from fsdp_optim.disk.objects import check_state_dict

            check_state_dict(opened.raw, str(path))  # its skeleton, before the summary walks it
            _inspect_full(opened.raw, out)
    return out


def _inspect_named(named: Any) -> list[str]:
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


def _inspect_shards(opened: Any, args: argparse.Namespace, out: list[str]) -> None:
    shards = opened.shards
    if True:
        rank0 = shards.rank0()
        kind = f"fairseq/metaseq shard set ({shards.metadata_key})"
        _inspect_manifest(shards.manifest, kind, out, units=args.units)
        size = sum(p.stat().st_size for p in shards.paths)
        out.insert(2, f"files: {len(shards.paths)} ({shards.label}), {human_bytes(size)}")
        recorded = " / ".join(n for n in shards.recorded_optimizer if n)
        if recorded:  # fairseq's own class: say which torch.optim class's state it keeps
            out[:] = [f"{line} (recorded: {recorded})" if line.startswith("optimizer: ") else line for line in out]
        extras = {k: _scalar(rank0["last_optimizer_state"][k]) for k in shards.extras}
        out.append(f"optimizer extras: {', '.join(f'{k}={v!r}' for k, v in extras.items()) or '-'}")
        unsaved = f"; not saved (non-persistent): {', '.join(shards.unsaved_buffers)}" if shards.unsaved_buffers else ""
        out.append(f"buffers: {', '.join(shards.buffers) or '-'}{unsaved}")
        kept = [k for k in rank0 if k not in ("model", "last_optimizer_state", shards.metadata_key)]
        out.append(f"other keys: {', '.join(kept) or '-'}")


def _verify(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.text import escape
    from fsdp_optim.offline.verify import verify

    report = verify(args.path, allow_globals=args.allow_global)
    lines = [f"path: {report.path}", f"format: {report.kind}", *report.lines()]
    if report.ok:
        return [*lines, f"verified: {len(report.files)} files, every one present, of its size, checksums matching"]
    print("\n".join(escape(line, limit=1 << 20) for line in lines), flush=True)
    raise ValueError(f"{args.path}: damaged: {'; '.join(report.damaged())}")


# ---------------------------------------------------------------------------------------------------
# the other verbs


def _open(args: argparse.Namespace, path: Any, **options: Any) -> Any:
    """The verb's source through the one way in, with the options every verb spells the same."""
    from fsdp_optim.offline.sources import open_source

    return open_source(
        path, layout=args.layout, optimizer=args.optimizer, allow_globals=args.allow_global, **options
    )


def _consolidate(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.staged import write_file
    from fsdp_optim.offline.operations import full_state
    from fsdp_optim.offline.sources import Kind

    with _open(args, args.directory) as opened, _progress("consolidate") as progress:
        shards = opened.kind is Kind.SHARD_SET
        if (args.with_model or args.no_model) and not shards:
            flag = "--with-model" if args.with_model else "--no-model"
            raise ValueError(f"{args.directory}: {flag} is for a fairseq/metaseq shard set only (it holds weights)")
        out = full_state(opened, progress=progress, fairseq_checkpoint=shards, with_model=not args.no_model)
        size = write_file(out, args.output, inputs=(args.directory, args.layout))
    if shards:
        full = out["last_optimizer_state"]
        model = f", model: {len(out['model'])} tensors" if "model" in out else ""
        return [
            f"wrote {args.output}: a consolidated fairseq checkpoint ({', '.join(out)}); last_optimizer_state: "
            f"{len(full['param_names'])} params, {len(full['state'])} with state{model}; {human_bytes(size)}"
        ]
    params, with_state = len(out["param_names"]), len(out["state"])
    return [f"wrote {args.output}: {params} params, {with_state} with state, {human_bytes(size)}"]


def _reshard(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.formats.fairseq.recut import reshard_set
    from fsdp_optim.formats.sharded.reader import read_manifest
    from fsdp_optim.offline.operations import reshard_opened

    out = Path(args.output)
    with _open(args, args.source, target=True) as opened, _progress(f"reshard -> {args.world_size} ranks") as bar:
        if opened.shards is not None:
            written = reshard_set(opened.shards, args.world_size, out, overwrite=args.overwrite, progress=bar)
            size = human_bytes(sum(f.stat().st_size for f in written))
            return [f"wrote {out}: {len(written)} shard files {written[0].name} .. {written[-1].name}, {size}"]
        manifest = reshard_opened(
            opened, args.world_size, out, layout=args.layout, given=args.source, progress=bar, overwrite=args.overwrite
        )
    files = read_manifest(manifest).files
    return [f"wrote {out}: {len(files)} rank files, {human_bytes(sum(f.nbytes for f in files))}"]


def _convert(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.staged import write_file
    from fsdp_optim.formats.fairscale import to_named
    from fsdp_optim.offline.operations import full_state
    from fsdp_optim.offline.sources import Kind

    with _open(args, args.source) as opened:
        origin = opened.kind.value
        if args.to == "safetensors":
            return _to_safetensors(opened, args, origin)
        if args.to == "dcp":
            return _to_dcp(opened, args, origin)
        if opened.kind is Kind.FULL:
            if args.to == "full":
                raise ValueError(f"{args.source}: already a full dict; use --to named to key it by parameter name")
            full = opened.full
        else:
            with _progress("consolidate") as progress:
                full = full_state(opened, progress=progress)
        result = to_named(full) if args.to == "named" else full
        size = write_file(result, args.output, inputs=(args.source, args.layout))
    return [f"wrote {args.output} ({args.to}, from a {origin}): {human_bytes(size)}"]


def _to_safetensors(opened: Any, args: argparse.Namespace, origin: str) -> list[str]:
    """``--to safetensors``: one named safetensors file (``<param name>/<state key>`` tensors) of any source."""
    from fsdp_optim.offline.named import write_opened

    with _progress("write safetensors") as progress:
        size = write_opened(opened, args.output, inputs=(args.source, args.layout), progress=progress, path=args.source)
    return [f"wrote {args.output} (safetensors, by parameter name, from a {origin}): {human_bytes(size)}"]


def _to_dcp(opened: Any, args: argparse.Namespace, origin: str) -> list[str]:
    from fsdp_optim.offline.export import export_opened

    with _progress("export to DCP") as progress:
        done = export_opened(opened, args.output, inputs=(args.source, args.layout), progress=progress)
    size = sum(f.stat().st_size for f in done.path.iterdir())
    lines = [
        f"wrote {done.path} (dcp, from a {origin}): model {done.model_tensors} tensors, optimizer state of "
        f"{done.optim_params} params, {human_bytes(size)}"
    ]
    if done.extras:
        lines.append(f"optimizer extras under 'optim_extra': {', '.join(done.extras)}")
    if done.not_exported:
        lines.append(f"not exported (no DCP counterpart): {', '.join(done.not_exported)}")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-optim",
        description="Inspect, consolidate, reshard and convert fsdp_optim optimizer checkpoints (no process group).",
        epilog="formats read: fsdp_optim sharded checkpoint directories, full dict files, fairscale-native dict "
        "files (with --layout), fairseq/metaseq shard sets (use_sharded_state: any *-shard<r>.pt file or the path "
        "before -shard). Formats written: sharded checkpoint, full dict, name-keyed dict, fairseq/metaseq shard "
        "set (reshard), consolidated fairseq checkpoint (consolidate), PyTorch DCP (convert --to dcp).",
    )
    from fsdp_optim import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB", help="what to do (VERB --help for more)")
    _add_inspect(verbs)
    _add_consolidate(verbs)
    _add_reshard(verbs)
    _add_convert(verbs)
    p = verbs.add_parser("verify", help="every file of a checkpoint: present, of its size, checksums matching")
    p.add_argument("path", help="a sharded checkpoint directory, a fairseq/metaseq shard set, or a single file")
    _allow_global(p)
    p.set_defaults(run=_verify)
    return parser


def _add_inspect(verbs: Any) -> None:
    p = verbs.add_parser("inspect", help="world size, units, params, optimizer, bytes, step of a checkpoint")
    p.add_argument(
        "path",
        help="a sharded checkpoint directory, a full dict, a fairscale-native dict, a layout file, or a "
        "fairseq/metaseq shard set (any *-shard<r>.pt file, or the path before -shard)",
    )
    p.add_argument("--units", action="store_true", help="also list every FSDP unit")
    _allow_global(p)
    p.set_defaults(run=_inspect)


def _add_consolidate(verbs: Any) -> None:
    p = verbs.add_parser(
        "consolidate",
        help="sharded checkpoint directory (or fairscale-native dict) -> one full dict file; fairseq/metaseq shard "
        "set -> one consolidated fairseq checkpoint",
    )
    p.add_argument(
        "directory",
        help="a sharded checkpoint directory, a fairscale-native dict file with --layout, or a fairseq/metaseq "
        "shard set (-> one consolidated fairseq checkpoint, every key kept)",
    )
    p.add_argument("-o", "--output", required=True, help="the file to write")
    p.add_argument(
        "--layout",
        help="a sharded checkpoint or layout file of the model: needed for a fairscale-native dict; for a shard "
        "set it numbers the parameters in the model's order (else the files' order)",
    )
    p.add_argument("--optimizer", help="for a fairscale-native dict or a shard set: the optimizer's class, e.g. Adam")
    p.add_argument(
        "--no-model", action="store_true", help="for a shard set: leave out the model's full weights (kept by default)"
    )
    p.add_argument("--with-model", action="store_true", help="for a shard set: keep the model's weights (the default)")
    _allow_global(p)
    p.set_defaults(run=_consolidate)


def _add_reshard(verbs: Any) -> None:
    p = verbs.add_parser(
        "reshard", help="sharded directory, full dict or fairseq/metaseq shard set -> the same for M ranks"
    )
    p.add_argument(
        "source",
        help="a sharded checkpoint directory, a full dict file, a fairscale-native dict file, or a fairseq/metaseq "
        "shard set (-> M shard files of the same format and names)",
    )
    p.add_argument("--world-size", type=int, required=True, metavar="M", help="the number of ranks to write files for")
    p.add_argument("-o", "--output", required=True, help="the directory to write (not the source's)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into -o even if it holds files that are not an fsdp_optim checkpoint's (they are kept)",
    )
    p.add_argument(
        "--layout", help="for a full or fairscale-native dict: a sharded checkpoint or layout file of the same model"
    )
    p.add_argument("--optimizer", help="for a fairscale-native dict: the optimizer's class name, e.g. Adam")
    _allow_global(p)
    p.set_defaults(run=_reshard)


def _add_convert(verbs: Any) -> None:
    p = verbs.add_parser(
        "convert", help="any source -> full dict, name-keyed dict, or a PyTorch DCP checkpoint (FSDP2, torchtitan)"
    )
    p.add_argument(
        "source",
        help="a fairscale-native dict, a full dict, a sharded checkpoint directory or a fairseq/metaseq shard set",
    )
    p.add_argument("-o", "--output", required=True, help="the file to write (--to dcp: the directory)")
    p.add_argument("--layout", help="for a fairscale-native dict: a sharded checkpoint or layout file of the model")
    p.add_argument("--optimizer", help="for a fairscale-native dict: the optimizer's class name, e.g. Adam")
    p.add_argument(
        "--to",
        choices=("full", "named", "dcp", "safetensors"),
        default="full",
        help="full: fsdp_optim's full dict (default); named: keyed by parameter name, for set_optimizer_state_dict; "
        "dcp: a torch.distributed.checkpoint directory (model weights too, from a shard set) for dcp.load; "
        "safetensors: one .safetensors file of <param name>/<state key> tensors (load_full_state reads it back)",
    )
    _allow_global(p)
    p.set_defaults(run=_convert)


def _allow_global(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="MODULE.CLASS",
        help="for a fairseq/metaseq shard set: allow this class in its cfg when loading (repeatable; only for "
        "files you trust)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        lines = args.run(args)
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        from fsdp_optim.disk.text import escape  # names and messages may carry a file's text: no terminal controls

        print(f"fsdp-optim: error: {escape(_one_line(exc), limit=2000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        print("fsdp-optim: internal error (please report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL
    from fsdp_optim.disk.text import escape

    try:
        for line in lines:
            print(escape(line, limit=1 << 20), flush=True)
    except BrokenPipeError:  # `fsdp-optim inspect ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    """The error on one line, an API parameter named at its start spelled as the command line's flag."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return re.sub(r"^(\w+):", lambda m: f"{_FLAGS.get(m.group(1), m.group(1))}:", message)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
