"""The command line's grammar: one ``_add_<verb>`` per verb; every flag has help text."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_optim.cli.arguments import allow_global, count, tolerance
from fsdp_optim.cli.inspect import run_diff, run_inspect, run_list, run_verify
from fsdp_optim.cli.verbs import run_consolidate, run_convert, run_reshard

Verbs = argparse._SubParsersAction  # what add_subparsers() returns: one add_parser() per verb


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-optim",
        description="Inspect, verify, compare, consolidate, reshard and convert fsdp_optim checkpoints (the "
        "optimizer state, or the whole training state: weights, buffers, optimizer, extra), with no process group.",
        epilog="formats read: fsdp_optim sharded checkpoint directories, full dict files, fairscale-native dict "
        "files (with --layout), fairseq/metaseq shard sets (use_sharded_state: any *-shard<r>.pt file or the path "
        "before -shard). Formats written: sharded checkpoint, full dict, name-keyed dict, fairseq/metaseq shard "
        "set (reshard), consolidated fairseq checkpoint (consolidate), PyTorch DCP (convert --to dcp), safetensors "
        "(convert --to safetensors).",
    )
    from fsdp_optim import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB", help="what to do (VERB --help for more)")
    _add_inspect(verbs)
    _add_consolidate(verbs)
    _add_reshard(verbs)
    _add_convert(verbs)
    _add_verify(verbs)
    _add_diff(verbs)
    _add_list(verbs)
    return parser


def _add_verify(verbs: Verbs) -> None:
    p = verbs.add_parser("verify", help="every file of a checkpoint: present, of its size, checksums matching")
    p.add_argument("path", help="a sharded checkpoint directory, a fairseq/metaseq shard set, or a single file")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also read the state for what a resumed run would trip on: NaN/Inf values, a negative second moment, "
        "steps that disagree in a param group, hyperparameters out of range (exit 1 naming each)",
    )
    p.add_argument(
        "--layout", help="with --deep: a sharded checkpoint or layout file of the model, to check parameters and shapes"
    )
    p.add_argument("--json", action="store_true", help="print the verdict, every file and every finding as JSON")
    allow_global(p)
    p.set_defaults(run=run_verify)


def _add_diff(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "diff",
        help="compare two sources of one model per parameter and state key (exit 0 equal, 1 different, 2 trouble)",
        description="Compare the optimizer state of A and B, whatever their formats, world sizes and nesting: per "
        "parameter and state key, bitwise equality, max abs / rel error, max ULP distance, NaN and Inf counts; "
        "hyperparameters, steps, and what is on one side only; a whole checkpoint's weights, buffers and extra "
        "tensors too. Reads one tensor of each side at a time.",
    )
    p.add_argument("a", help="a sharded checkpoint directory, full dict file, named safetensors file or shard set")
    p.add_argument("b", help="the same kinds as A (the reference of relative errors)")
    p.add_argument("--atol", type=tolerance, default=0.0, help="absolute tolerance (default 0: bitwise)")
    p.add_argument("--rtol", type=tolerance, default=0.0, help="tolerance relative to |B| (default 0: bitwise)")
    p.add_argument("--json", action="store_true", help="print the whole report (every row) as JSON")
    p.add_argument("--limit", type=count(0), default=20, metavar="N", help="rows of differences shown (default 20)")
    allow_global(p)
    p.set_defaults(run=run_diff)


def _add_list(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "list", help="the step directories of a CheckpointManager root: state, world size, what each holds, bytes"
    )
    p.add_argument("root", help="the root directory given to fsdp_optim.CheckpointManager")
    p.add_argument("--json", action="store_true", help="one JSON object: {root, steps: [{step, state, ...}]}")
    p.add_argument(
        "--quick", action="store_true", help="check the files' presence and sizes only (default: every checksum)"
    )
    p.add_argument(
        "--memory-dir",
        help="also list the memory tier of this machine's nodes under this directory (CheckpointManager's memory_dir; "
        "'default' for the manager's default, /dev/shm/fsdp_optim-<hash of ROOT>)",
    )
    p.set_defaults(run=run_list)



def _add_inspect(verbs: Verbs) -> None:
    p = verbs.add_parser("inspect", help="world size, units, params, optimizer, bytes, step of a checkpoint")
    p.add_argument(
        "path",
        help="a sharded checkpoint directory, a full dict, a fairscale-native dict, a layout file, a "
        "fairseq/metaseq shard set (any *-shard<r>.pt file, or the path before -shard), a named safetensors file, "
        "a name-keyed dict (convert --to named) or a DCP directory (convert --to dcp)",
    )
    p.add_argument(
        "--units",
        action="store_true",
        help="also list every FSDP unit with its parameters' names and shapes (a dict: every parameter's state; a "
        "DCP directory: every tensor)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object: each 'key: value' line a member, each table a list"
    )
    allow_global(p)
    p.set_defaults(run=run_inspect)



def _add_consolidate(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "consolidate",
        help="sharded checkpoint directory (or fairscale-native dict) -> one full dict file; a whole checkpoint "
        "(save_checkpoint) -> one file {'model': unwrapped state_dict, 'optimizer': full dict, 'extra'}; "
        "fairseq/metaseq shard set -> one consolidated fairseq checkpoint",
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a sharded checkpoint directory (optimizer-only or whole), a fairscale-native dict file with --layout, "
        "or a fairseq/metaseq shard set (any *-shard<r>.pt file or the path before -shard: -> one consolidated "
        "fairseq checkpoint, every key kept)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="the file to write (an existing one: see --overwrite; not a directory): a torch file, or with a "
        ".safetensors name one safetensors file (weights, buffers and optimizer state by name, the settings in its "
        "metadata; our sharded checkpoint, whole or optimizer-only; split across the processes under torchrun)",
    )
    _overwrite_file(p)
    p.add_argument(
        "--layout",
        help="a sharded checkpoint or layout file of the model: needed for a fairscale-native dict; for a shard "
        "set it numbers the parameters in the model's order (else the files' order)",
    )
    p.add_argument("--optimizer", help="for a fairscale-native dict or a shard set: the optimizer's class, e.g. Adam")
    p.add_argument(
        "--no-model",
        action="store_true",
        help="for a shard set or a whole checkpoint: leave out the model's full weights (kept by default); a whole "
        "checkpoint then gives the optimizer's full dict alone",
    )
    p.add_argument("--with-model", action="store_true", help=argparse.SUPPRESS)  # deprecated: the default
    p.add_argument(
        "--rank",
        type=count(0),
        metavar="R",
        help="for a whole checkpoint: whose side file gives extra (default 0) and, when they were saved per rank, "
        "the buffers (then required)",
    )
    allow_global(p)
    p.set_defaults(run=run_consolidate, check=check_consolidate, usage_error=p.error)


def check_consolidate(args: argparse.Namespace) -> str | None:
    """A usage error (the message) for ``--no-model`` with the deprecated ``--with-model``; a deprecation warning
    (stderr) for ``--with-model`` alone."""
    if args.with_model and args.no_model:
        return "--with-model and --no-model contradict each other (the weights are kept unless --no-model)"
    if args.with_model:
        print("fsdp-optim: warning: --with-model is deprecated: the weights are kept by default (--no-model leaves "
              "them out); drop it", file=sys.stderr)  # fmt: skip
    return None



def _add_reshard(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "reshard", help="sharded directory, full dict or fairseq/metaseq shard set -> the same for M ranks"
    )
    p.add_argument(
        "source",
        help="a sharded checkpoint directory, a full dict file, a fairscale-native dict file, or a fairseq/metaseq "
        "shard set (-> M shard files of the same format and names)",
    )
    p.add_argument(
        "--world-size", type=count(1), required=True, metavar="M", help="the number of ranks to write files for"
    )
    p.add_argument("-o", "--output", required=True, help="the directory to write (not the source's)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a checkpoint already in -o, and write there even if it holds files that are not an "
        "fsdp_optim checkpoint's (those are kept)",
    )
    p.add_argument(
        "--layout", help="for a full or fairscale-native dict: a sharded checkpoint or layout file of the same model"
    )
    p.add_argument("--optimizer", help="for a fairscale-native dict: the optimizer's class name, e.g. Adam")
    p.add_argument(
        "--buffers",
        choices=("refuse", "rank0", "mean"),
        default="refuse",
        help="a whole checkpoint whose buffers differed across its ranks (BatchNorm's running statistics) to another "
        "world size: refuse (the default), rank0 (saved rank 0's), or mean (each floating-point buffer's mean across "
        "the saved ranks; rank 0's integer buffers)",
    )
    _param_names(p)
    allow_global(p)
    p.set_defaults(run=run_reshard)



def _add_convert(verbs: Verbs) -> None:
    p = verbs.add_parser(
        "convert",
        help="any source -> full dict, name-keyed dict, safetensors (a whole checkpoint: Hugging Face model files), "
        "or a PyTorch DCP checkpoint (FSDP2, torchtitan)",
    )
    p.add_argument(
        "source",
        help="a fairscale-native dict, a full dict, a sharded checkpoint directory or a fairseq/metaseq shard set",
    )
    p.add_argument("-o", "--output", required=True, help="the file to write (--to dcp: the directory)")
    _overwrite_file(p)
    p.add_argument("--layout", help="for a fairscale-native dict: a sharded checkpoint or layout file of the model")
    p.add_argument("--optimizer", help="for a fairscale-native dict: the optimizer's class name, e.g. Adam")
    p.add_argument(
        "--to",
        choices=("full", "named", "dcp", "safetensors"),
        default=None,
        help="full: fsdp_optim's full dict (the default, and for a -o ending in .pt or .pth); named: keyed by "
        "parameter name, for set_optimizer_state_dict; dcp: a torch.distributed.checkpoint directory (model "
        "weights too, from a shard set or a whole checkpoint) for dcp.load; safetensors: one .safetensors file of "
        "<param name>/<state key> tensors (load_full_state reads it back; the default for a -o ending in "
        ".safetensors); of a whole checkpoint, a directory -o DIR: model.safetensors (or "
        "model-0000k-of-0000N.safetensors and model.safetensors.index.json, as Hugging Face shards them) and "
        "optimizer.safetensors",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="--to safetensors of a whole checkpoint: the largest model file before it is split, as Hugging Face "
        "spells it (default 5GB = 5*10**9 bytes; 500MiB, or bytes)",
    )
    p.add_argument(
        "--optim-key",
        metavar="KEY",
        help="--to dcp: the top-level key the optimizer state goes under (default: optimizer, as torchtitan names "
        "it); the loading job's dcp.load dict must use the same key (the output says which was written)",
    )
    _param_names(p)
    allow_global(p)
    p.set_defaults(run=run_convert, check=check_convert_target, usage_error=p.error)


# What each known extension of -o is written as (the first is the default for it); another is refused.
_EXTENSION_TARGETS = {".safetensors": ("safetensors",), ".pt": ("full", "named"), ".pth": ("full", "named")}


def check_convert_target(args: argparse.Namespace) -> str | None:
    """Set ``args.to`` from ``-o``'s extension when ``--to`` is not given; a usage error (the message) when
    ``--to`` writes something else than the extension says (a torch pickle named ``.safetensors``), or an option
    is given that the target does not take."""
    suffix = Path(args.output).suffix.lower()
    allowed = _EXTENSION_TARGETS.get(suffix)
    if args.to is None:
        args.to = allowed[0] if allowed is not None else "full"
    elif allowed is not None and args.to not in allowed:
        return (
            f"-o {args.output}: a {suffix} name is for --to {' or --to '.join(allowed)}, but --to {args.to} was "
            f"given (it writes {_WRITES[args.to]}); rename the output or drop --to"
        )
    if args.max_shard_size is not None and args.to != "safetensors":
        return f"--max-shard-size applies to --to safetensors (of a whole checkpoint), not --to {args.to}"
    if args.optim_key is not None and args.to != "dcp":
        return "--optim-key applies to --to dcp only (the key of the optimizer state in a DCP checkpoint)"
    if args.optim_key is not None and (not args.optim_key or "." in args.optim_key or args.optim_key == "model"):
        return f"--optim-key {args.optim_key!r}: expected a top-level key without '.', other than 'model'"
    return None


_WRITES = {
    "full": "a torch file of the full dict",
    "named": "a torch file keyed by parameter name",
    "dcp": "a DCP directory",
    "safetensors": "a safetensors file",
}



def _overwrite_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a file already at -o (without it, an existing file is refused and left as it was)",
    )


def _param_names(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--param-names",
        metavar="FILE",
        help="the source is a plain (non-FSDP) optimizer's state_dict(): name its parameters with this JSON file, a "
        "list of the model's named_parameters() names in the optimizer's order, or an object {name: shape} (shapes "
        "then checked), e.g. json.dump({n: list(p.shape) for n, p in model.named_parameters()}, f)",
    )
