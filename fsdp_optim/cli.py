"""``fsdp-optim``: inspect, consolidate, reshard and convert optimizer checkpoints, with no process group.

    fsdp-optim inspect PATH [--units]
    fsdp-optim consolidate SRC -o FILE [--layout PATH] [--optimizer NAME] [--with-model]
    fsdp-optim reshard SRC --world-size M -o DIR [--layout PATH] [--optimizer NAME]
    fsdp-optim convert SRC -o FILE|DIR [--layout PATH] [--optimizer NAME] [--to full|named|dcp]

Sources: a sharded checkpoint directory of ours, a full dict file, a fairscale-native dict file, and a
fairseq/metaseq shard set (``use_sharded_state``: any ``*-shard<r>.pt`` file of the set, or the path before
``-shard``; ``--allow-global module.Class`` allows a class its ``cfg`` holds, see :mod:`fsdp_optim.fairseq_format`).
A shard set is consolidated into one fairseq-shaped checkpoint (every key kept, ``last_optimizer_state`` our
full dict, ``model`` the full weights with ``--with-model``) and resharded into shard files of the same format.

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

    keys: dict[str, str] = {}
    steps = []
    for flat in manifest.flat_params:
        for e in flat.state:
            keys.setdefault(e.key, e.dtype if e.kind is StateKind.SHARDED else "scalar")  # type: ignore[arg-type]
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
    keys: dict[str, str] = {}
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
    from fsdp_optim.disk.atomic import load_file
    from fsdp_optim.formats.sharded.manifest import HEADER_KEY
    from fsdp_optim.formats.sharded.reader import read_manifest, source_kind

    path = Path(args.path)
    out = [f"path: {path}"]
    if _is_shard_set(path):
        _inspect_shards(path, args, out)
        return out
    if source_kind(path) == "sharded":
        _inspect_manifest(read_manifest(path), "sharded checkpoint", out, units=args.units)
        return out
    if path.suffix == ".safetensors":
        from fsdp_optim.formats.sharded.rank_file import describe_rank_file

        return out + describe_rank_file(path)
    obj = load_file(path, mmap=True)
    header = obj.get(HEADER_KEY) if isinstance(obj, Mapping) else None
    if isinstance(header, Mapping) and header.get("kind") == "manifest":
        _inspect_manifest(read_manifest(path), "layout file", out, units=args.units)
    elif isinstance(header, Mapping) and header.get("kind") == "shard":
        out += [
            "format: one rank file of a sharded checkpoint (inspect its directory for the whole)",
            f"rank: {header.get('rank')} of {header.get('world_size')}",
            f"flat parameters with state: {len(obj.get('state', {}))}",
        ]
    elif isinstance(obj, Mapping) and {"state", "param_groups"} <= set(obj):
        from fsdp_optim.disk.untrusted import check_state_dict

        check_state_dict(obj, str(path))  # its skeleton, before the summary walks it
        _inspect_full(obj, out)
    else:
        found = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
        raise ValueError(f"{path}: not an optimizer checkpoint this tool knows (found {found})")
    return out


def _is_shard_set(path: str | os.PathLike[str]) -> bool:
    from fsdp_optim.formats.fairseq.files import is_shard_set

    return is_shard_set(path)


def _inspect_shards(path: Path, args: argparse.Namespace, out: list[str]) -> None:
    from fsdp_optim.offline.fairseq import ShardSet

    with ShardSet(path, allow_globals=args.allow_global) as shards:
        rank0 = shards.rank0()
        kind = f"fairseq/metaseq shard set ({shards.metadata_key})"
        _inspect_manifest(shards.manifest, kind, out, units=args.units)
        size = sum(p.stat().st_size for p in shards.paths)
        out.insert(2, f"files: {len(shards.paths)} ({shards.label}), {human_bytes(size)}")
        extras = {k: _scalar(rank0["last_optimizer_state"][k]) for k in shards.extras}
        out.append(f"optimizer extras: {', '.join(f'{k}={v!r}' for k, v in extras.items()) or '-'}")
        kept = [k for k in rank0 if k not in ("model", "last_optimizer_state", shards.metadata_key)]
        out.append(f"other keys: {', '.join(kept) or '-'}")


# ---------------------------------------------------------------------------------------------------
# the other verbs


def _native(path: str | os.PathLike[str]) -> Mapping[str, Any] | None:
    """The fairscale-native dict in the file at ``path``; ``None`` for anything else, including a path
    that cannot be read (the verb itself then says what is wrong with it)."""
    from fsdp_optim.disk.atomic import load_file
    from fsdp_optim.formats.fairscale import is_fairscale_native
    from fsdp_optim.formats.sharded.reader import source_kind

    try:
        if source_kind(path) != "file":
            return None
        obj = load_file(path, mmap=True)
    except (ValueError, TypeError, OSError):
        return None
    return obj if is_fairscale_native(obj) else None


def _from_native(native: Mapping[str, Any], args: argparse.Namespace, source: str, verb: str) -> tuple[Any, Any]:
    """(our full dict, the model's layout) for a fairscale-native ``source``; ``--layout`` is required."""
    from fsdp_optim.formats.fairscale import from_fairscale
    from fsdp_optim.offline.operations import resolve_layout

    if args.layout is None:
        raise ValueError(
            f"layout: {source} is a fairscale-native dict, which names no parameters; to {verb} it, fsdp-optim needs "
            f"{_NEEDS_LAYOUT}"
        )
    layout = resolve_layout(args.layout)
    return from_fairscale(native, layout, optimizer=args.optimizer), layout


def _consolidate(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.formats.sharded.writer import write_file
    from fsdp_optim.offline.operations import consolidate

    if _is_shard_set(args.directory):
        return _consolidate_shards(args)
    if args.with_model:
        raise ValueError(f"{args.directory}: --with-model is for a fairseq/metaseq shard set only (it holds weights)")
    native = _native(args.directory)
    if native is not None:
        full, _ = _from_native(native, args, args.directory, "consolidate")
    else:
        if args.layout is not None or args.optimizer is not None:
            raise ValueError(f"layout: {args.directory}: --layout and --optimizer are for a fairscale-native dict only")
        with _progress("consolidate") as progress:
            full = consolidate(args.directory, progress=progress)
    size = write_file(full, args.output, inputs=(args.directory, args.layout))
    params, with_state = len(full["param_names"]), len(full["state"])
    return [f"wrote {args.output}: {params} params, {with_state} with state, {human_bytes(size)}"]


def _consolidate_shards(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.atomic import atomic_save
    from fsdp_optim.offline.fairseq import consolidate_shards

    with _progress("consolidate") as progress:
        out = consolidate_shards(
            args.directory,
            with_model=args.with_model,
            param_order=args.layout,
            optimizer=args.optimizer,
            allow_globals=args.allow_global,
            progress=progress,
        )
    size = atomic_save(out, args.output)
    full = out["last_optimizer_state"]
    model = f", model: {len(out['model'])} tensors" if "model" in out else ""
    return [
        f"wrote {args.output}: a consolidated fairseq checkpoint ({', '.join(out)}); last_optimizer_state: "
        f"{len(full['param_names'])} params, {len(full['state'])} with state{model}; {human_bytes(size)}"
    ]


def _reshard(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.formats.sharded.reader import read_manifest
    from fsdp_optim.offline.operations import reshard

    if _is_shard_set(args.source):
        from fsdp_optim.offline.fairseq import reshard_shards

        if args.layout is not None or args.optimizer is not None:
            raise ValueError(f"layout: {args.source}: a fairseq/metaseq shard set carries its own layout and optimizer")
        with _progress(f"reshard -> {args.world_size} ranks") as progress:
            written = reshard_shards(
                args.source,
                args.world_size,
                args.output,
                overwrite=args.overwrite,
                allow_globals=args.allow_global,
                progress=progress,
            )
        size = human_bytes(sum(f.stat().st_size for f in written))
        return [f"wrote {args.output}: {len(written)} shard files {written[0].name} .. {written[-1].name}, {size}"]
    source, layout = args.source, args.layout
    native = _native(source)
    if native is not None:
        source, layout = _from_native(native, args, args.source, "reshard")
    elif args.optimizer is not None:
        raise ValueError(f"{args.source}: --optimizer is for a fairscale-native dict only (other sources record it)")
    with _progress(f"reshard -> {args.world_size} ranks") as progress:
        manifest = reshard(
            source, args.world_size, args.output, layout=layout, progress=progress, overwrite=args.overwrite
        )
    files = read_manifest(manifest).files
    return [f"wrote {args.output}: {len(files)} rank files, {human_bytes(sum(f.nbytes for f in files))}"]


def _convert(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.core.preconditions import is_full_dict
    from fsdp_optim.disk.atomic import load_file
    from fsdp_optim.formats.fairscale import is_fairscale_native, to_named
    from fsdp_optim.formats.sharded.reader import source_kind
    from fsdp_optim.formats.sharded.writer import write_file
    from fsdp_optim.offline.operations import consolidate

    source = Path(args.source)
    full: Mapping[str, Any]
    if _is_shard_set(source):
        if args.to == "dcp":
            return _to_dcp(source, args, "fairseq/metaseq shard set")
        from fsdp_optim.offline.fairseq import consolidate_shards

        with _progress("consolidate") as progress:
            out = consolidate_shards(
                source,
                param_order=args.layout,
                optimizer=args.optimizer,
                allow_globals=args.allow_global,
                progress=progress,
            )
        full, origin = out["last_optimizer_state"], "fairseq/metaseq shard set"
    elif source_kind(source) == "sharded":
        if args.to == "dcp":
            return _to_dcp(source, args, "sharded checkpoint")
        with _progress("consolidate") as progress:
            full = consolidate(source, progress=progress)
        origin = "sharded checkpoint"
    else:
        obj = load_file(source, mmap=True)
        if is_fairscale_native(obj):
            full, _ = _from_native(obj, args, str(source), "convert")
            origin = "fairscale-native dict"
        elif is_full_dict(obj):
            if args.to == "dcp":
                return _to_dcp(obj, args, "full dict")
            if args.to == "full":
                raise ValueError(f"{source}: already a full dict; use --to named to key it by parameter name")
            full, origin = obj, "full dict"
        else:
            found = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
            raise ValueError(
                f"{source}: expected a fairscale-native dict, a full dict or a sharded checkpoint, found {found}"
            )
    if args.to == "dcp":
        return _to_dcp(full, args, origin)
    result = to_named(full) if args.to == "named" else full
    size = write_file(result, args.output, inputs=(args.source, args.layout))
    return [f"wrote {args.output} ({args.to}, from a {origin}): {human_bytes(size)}"]


def _to_dcp(source: Any, args: argparse.Namespace, origin: str) -> list[str]:
    from fsdp_optim.offline.export import to_dcp

    shards = origin.startswith("fairseq")
    with _progress("export to DCP") as progress:
        done = to_dcp(
            source,
            args.output,
            param_order=args.layout if shards else None,
            allow_globals=args.allow_global,
            progress=progress,
        )
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
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    _add_inspect(verbs)
    _add_consolidate(verbs)
    _add_reshard(verbs)
    _add_convert(verbs)
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
    p.add_argument("--with-model", action="store_true", help="for a shard set: also the model's full weights")
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
    p.add_argument("--world-size", type=int, required=True, metavar="M")
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
        choices=("full", "named", "dcp"),
        default="full",
        help="full: fsdp_optim's full dict (default); named: keyed by parameter name, for set_optimizer_state_dict; "
        "dcp: a torch.distributed.checkpoint directory (model weights too, from a shard set) for dcp.load",
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
        from fsdp_optim.disk.untrusted import escape  # names and messages may carry a file's text: no terminal controls

        print(f"fsdp-optim: error: {escape(_one_line(exc), limit=2000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        print("fsdp-optim: internal error (please report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL
    from fsdp_optim.disk.untrusted import escape

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
