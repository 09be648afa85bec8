"""``fsdp-optim consolidate``, ``reshard`` and ``convert``: each opens its source through the one way in
(:func:`fsdp_optim.offline.sources.open_source`) and writes through the one way out (``disk/local_directory.py``);
the words of their ``wrote <output>: ...`` lines, from the records of what an opened input's write returned
(:mod:`fsdp_optim.offline.opened.written`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_optim.cli.arguments import UsageError

if TYPE_CHECKING:
    from fsdp_optim.offline.cuts import Progress
    from fsdp_optim.offline.opened.base import Opened
    from fsdp_optim.offline.opened.written import Consolidation, Resharding
from fsdp_optim.disk.text import human_bytes


@contextlib.contextmanager
def progress_bar(desc: str) -> Iterator[Callable[[], None] | None]:
    """A callback drawing a ``tqdm`` bar on a terminal (``None`` elsewhere), left on screen when done."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc=desc, unit="step", leave=True) as bar:  # steps: units, tensors or ranks, as the verb counts
        yield lambda: bar.update()



def _open(args: argparse.Namespace, path: str, *, target: bool = False) -> AbstractContextManager[Opened]:
    """The verb's source through the one way in, with the options every verb spells the same."""
    from fsdp_optim.formats.plain import param_names_file
    from fsdp_optim.offline.sources import open_source

    names = getattr(args, "param_names", None)
    return open_source(
        path, layout=args.layout, optimizer=args.optimizer, allow_globals=args.allow_global, target=target,
        param_names=None if names is None else param_names_file(names),
    )



def _file_output(output: str, verb: str) -> None:
    """Refuse an ``-o`` that is an existing directory where the verb writes one file (``--overwrite`` replaces a
    file, never a directory)."""
    if os.path.isdir(output):
        raise ValueError(
            f"-o {output}: an existing directory, but {verb} writes one file; name the file (e.g. "
            f"{os.path.join(output, 'consolidated.pt' if verb == 'consolidate' else 'optim.pt')})"
        )


@contextlib.contextmanager
def checked_opening(args: argparse.Namespace) -> Iterator[Opened]:
    """consolidate's source opened, once its ``-o`` and its flags are checked against it."""
    _file_output(args.output, "consolidate")
    with _open(args, args.source) as opened:
        if (args.with_model or args.no_model) and not opened.holds_weights():
            flag = "--with-model" if args.with_model else "--no-model"
            raise ValueError(
                f"{args.source}: {flag} is for a fairseq/metaseq shard set or a whole checkpoint only (they hold "
                "weights)"
            )
        yield opened


def run_consolidate(args: argparse.Namespace) -> list[str]:
    with checked_opening(args) as opened, progress_bar("consolidate") as progress:
        if is_safetensors_name(args.output):
            return [f"wrote {args.output}: {_consolidate_safetensors(opened, args, progress)}"]
        done = opened.write_consolidated(args.output, rank=args.rank, no_model=args.no_model,
                                         inputs=(args.source, args.layout), overwrite=args.overwrite,
                                         progress=progress)  # fmt: skip
    return [f"wrote {args.output}: {consolidated_words(done)}"]


def is_safetensors_name(output: str) -> bool:
    """Whether consolidate's ``-o`` asks for one safetensors file (by its name)."""
    return Path(output).suffix.lower() == ".safetensors"


def _consolidate_safetensors(opened: Opened, args: argparse.Namespace, progress: Progress) -> str:
    """``consolidate -o FILE.safetensors`` by this process: our sharded checkpoint (whole or optimizer-only)."""
    from fsdp_optim.formats.kinds import Kind
    from fsdp_optim.offline.onefile import consolidate_to_safetensors

    if opened.kind is not Kind.SHARDED:
        raise UsageError(f"-o {args.output}: consolidate writes one safetensors file of our sharded checkpoint "
                         f"(whole or optimizer-only); {args.source} is a {opened.kind.value}: convert it with "
                         "fsdp-optim convert SOURCE --to safetensors -o OUT")  # fmt: skip
    # a local file, or an object written straight into its store (uploads_itself): the parts of one multipart upload
    return consolidate_to_safetensors(opened, args.output, rank=args.rank, no_model=args.no_model,
                                      inputs=(args.source, args.layout), overwrite=args.overwrite,
                                      progress=progress)  # fmt: skip


def uploads_itself(args: argparse.Namespace) -> bool:
    """Whether the verb writes its ``-o`` URL itself (``consolidate -o URL.safetensors`` into a store that takes
    multipart uploads) instead of a local file uploaded once written."""
    from fsdp_optim.disk.location import shared_directory
    from fsdp_optim.disk.locations import where

    output = str(getattr(args, "output", ""))
    if args.run is not run_consolidate or not is_safetensors_name(output):
        return False
    if shared_directory(where(output)) is not None:
        return False
    parent, name = output.rstrip("/").rsplit("/", 1)
    return where(parent).multipart(name) is not None


def run_reshard(args: argparse.Namespace) -> list[str]:
    out = Path(args.output)
    with _open(args, args.source, target=True) as opened, progress_bar(f"reshard -> {args.world_size} ranks") as bar:
        # A checkpoint already in -o is replaced only with --overwrite (the API replaces it atomically).
        done = opened.write_resharded(
            args.world_size, out, layout=args.layout, given=args.source, progress=bar, overwrite=args.overwrite,
            after_file=getattr(args, "after_file", None), buffers=args.buffers,
        )
    return [f"wrote {out}: {resharded_words(done)}"]



def run_convert(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.one_file import write_file
    from fsdp_optim.formats.fairscale import to_named

    with _open(args, args.source) as opened:
        origin = opened.kind.value
        if args.to == "safetensors":
            return _to_safetensors(opened, args, origin)
        if args.to == "dcp":
            return _to_dcp(opened, args, origin)
        _file_output(args.output, f"convert --to {args.to}")
        if opened.is_full_dict():
            if args.to == "full" and args.param_names is None:  # a plain dict named is a full dict made
                raise ValueError(f"{args.source}: already a full dict; use --to named to key it by parameter name")
            full = opened.full_dict()
        else:
            with progress_bar("consolidate") as progress:
                full = opened.full_dict(progress=progress)
        result = to_named(full) if args.to == "named" else full
        size = write_file(result, args.output, inputs=(args.source, args.layout), overwrite=args.overwrite)
        left = _left_out(opened, "a full dict" if args.to == "full" else "a name-keyed dict", "the optimizer state")
    return [f"wrote {args.output} ({args.to}, from a {origin}): {human_bytes(size)}", *left]


def _left_out(opened: Opened, written: str, holds: str, parts: str = "the model's weights, buffers and extra"
              ) -> list[str]:  # fmt: skip
    """The line that says what of a source holding a model a conversion did not write (none for other sources)."""
    if not opened.holds_weights():
        return []
    keep = "consolidate it to a .pt or .safetensors file" if opened.is_whole() else "consolidate it --with-model"
    return [f"not written ({written} holds {holds} only): {parts}; to keep everything, {keep}"]



def _to_safetensors(opened: Opened, args: argparse.Namespace, origin: str) -> list[str]:
    """``--to safetensors``: one named safetensors file (``<param name>/<state key>`` tensors) of any source."""
    from fsdp_optim.offline.named import write_opened

    if opened.is_whole() and is_safetensors_name(args.output):
        raise UsageError(
            f"-o {args.output}: a whole checkpoint converts to a directory (model.safetensors, or its shards and "
            "index, and optimizer.safetensors), not one .safetensors file; name the directory without .safetensors"
        )
    if not opened.is_whole():
        _file_output(args.output, "convert --to safetensors")
    with progress_bar("write safetensors") as progress:
        size = write_opened(opened, args.output, inputs=(args.source, args.layout), progress=progress, path=args.source,
                            max_shard_size=args.max_shard_size, overwrite=args.overwrite)  # fmt: skip
    if opened.is_whole():
        names = ", ".join(sorted(p.name for p in Path(args.output).iterdir()))
        return [f"wrote {args.output} (safetensors: the model as Hugging Face stores it, the optimizer by parameter "
                f"name; from a whole {origin}): {names}; {human_bytes(size)}",
                *_left_out(opened, "the Hugging Face layout", "the model and the optimizer state",
                           "extra")]  # fmt: skip
    return [f"wrote {args.output} (safetensors, by parameter name, from a {origin}): {human_bytes(size)}",
            *_left_out(opened, "a named safetensors file", "the optimizer state", "the model's weights and buffers")]



def _to_dcp(opened: Opened, args: argparse.Namespace, origin: str) -> list[str]:
    from fsdp_optim.offline.export import export_opened

    with progress_bar("export to DCP") as progress:
        done = export_opened(opened, args.output, inputs=(args.source, args.layout), progress=progress,
                             optim_key=args.optim_key or "optimizer")  # fmt: skip
    size = sum(f.stat().st_size for f in done.path.iterdir())
    lines = [
        f"wrote {done.path} (dcp, from a {origin}): model {done.model_tensors} tensors, optimizer state of "
        f"{done.optim_params} params under '{done.optim_key}', {human_bytes(size)}",
        f"load it with the keys {{'model': ..., '{done.optim_key}': ...}} (get_state_dict, dcp.load, set_state_dict)",
    ]
    if done.extras:
        lines.append(f"optimizer extras under '{done.optim_key}_extra': {', '.join(done.extras)}")
    if done.not_exported:
        lines.append(f"not exported (no DCP counterpart): {', '.join(done.not_exported)}")
    return lines


def consolidated_words(done: Consolidation) -> str:
    """What ``consolidate`` wrote, after ``wrote <output>: ``."""
    from fsdp_optim.offline.opened.written import FairseqCheckpoint, FullDictFile, WholeFileWritten

    if isinstance(done, FullDictFile):
        return f"{done.params} params, {done.with_state} with state, {human_bytes(done.size)}"
    if isinstance(done, WholeFileWritten):
        optim = ("none (saved with optim=None)" if done.optimizer_params is None
                 else f"{done.optimizer_params} params with state")  # fmt: skip
        return (
            f"{{'model', 'optimizer', 'extra'}}: model {done.params} params ({human_bytes(done.param_bytes)}), "
            f"{_count(done.tied_names, 'tied name')}, {_count(done.buffers, 'buffer')}; "
            f"optimizer {optim}; extra of rank {done.rank}; {human_bytes(done.size)}"
        )
    if isinstance(done, FairseqCheckpoint):
        model = "" if done.model_tensors is None else f", model: {done.model_tensors} tensors"
        return (
            f"a consolidated fairseq checkpoint ({', '.join(done.keys)}); {done.optim_key}: "
            f"{done.params} params, {done.with_state} with state{model}; {human_bytes(done.size)}"
        )
    what = "the optimizer's full dict" if done.optimizer_only else "{'model', 'optimizer', 'extra'}"
    return f"{what} of {done.label}, {human_bytes(done.size)}"


def resharded_words(done: Resharding) -> str:
    """What ``reshard`` wrote, after ``wrote <out>: ``."""
    from fsdp_optim.offline.opened.written import ShardFiles

    if isinstance(done, ShardFiles):
        return f"{len(done.names)} shard files {done.names[0]} .. {done.names[-1]}, {human_bytes(done.size)}"
    line = f"{done.rank_files} rank files, {human_bytes(done.rank_bytes)}"
    if done.side_files is not None:  # a whole checkpoint: weights in the rank files, side files carried
        line += f" (weights included), {done.side_files} side files, {human_bytes(done.side_bytes)}"
    return line


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
