"""``fsdp-optim consolidate``, ``reshard`` and ``convert``: each opens its source through the one way in
(:func:`fsdp_optim.offline.sources.open_source`) and writes through the one way out (``disk/staged.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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



def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _open(args: argparse.Namespace, path: Any, **options: Any) -> Any:
    """The verb's source through the one way in, with the options every verb spells the same."""
    from fsdp_optim.formats.plain import param_names_file
    from fsdp_optim.offline.sources import open_source

    names = getattr(args, "param_names", None)
    if names is not None:
        options["param_names"] = param_names_file(names)
    return open_source(
        path, layout=args.layout, optimizer=args.optimizer, allow_globals=args.allow_global, **options
    )



def run_consolidate(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.staged import write_file
    from fsdp_optim.offline.operations import full_state
    from fsdp_optim.offline.whole import check_whole_options, is_whole

    with _open(args, args.directory) as opened, progress_bar("consolidate") as progress:
        shards = opened.shards is not None
        if opened.whole_file is not None:  # consolidate's own output, written again (or its optimizer alone)
            return _consolidate_whole_file(opened, args)
        whole = is_whole(opened.checkpoint)
        if (args.with_model or args.no_model) and not (shards or whole):
            flag = "--with-model" if args.with_model else "--no-model"
            raise ValueError(
                f"{args.directory}: {flag} is for a fairseq/metaseq shard set or a whole checkpoint only (they hold "
                "weights)"
            )
        if whole and not args.no_model:
            return _consolidate_whole(opened, args, progress)
        check_whole_options(opened.checkpoint, args.rank)
        out = full_state(opened, progress=progress, fairseq_checkpoint=shards, with_model=not args.no_model)
        size = write_file(out, args.output, inputs=(args.directory, args.layout), overwrite=args.overwrite)
    if shards:
        full = out["last_optimizer_state"]
        model = f", model: {len(out['model'])} tensors" if "model" in out else ""
        return [
            f"wrote {args.output}: a consolidated fairseq checkpoint ({', '.join(out)}); last_optimizer_state: "
            f"{len(full['param_names'])} params, {len(full['state'])} with state{model}; {human_bytes(size)}"
        ]
    params, with_state = len(out["param_names"]), len(out["state"])
    return [f"wrote {args.output}: {params} params, {with_state} with state, {human_bytes(size)}"]


def _consolidate_whole(opened: Any, args: argparse.Namespace, progress: Callable[[], None] | None) -> list[str]:
    """A whole checkpoint -> one file ``{"model", "optimizer", "extra"}``, each parameter streamed."""
    from fsdp_optim.offline.operations import optimizer_of
    from fsdp_optim.offline.whole import whole_model, write_whole

    whole = whole_model(opened.checkpoint, rank=args.rank, progress=progress)
    optimizer = optimizer_of(opened, progress)
    size = write_whole(whole, optimizer, args.output, inputs=(args.directory, args.layout), overwrite=args.overwrite)
    optim = "none (saved with optim=None)" if optimizer is None else f"{len(optimizer['state'])} params with state"
    return [
        f"wrote {args.output}: {{'model', 'optimizer', 'extra'}}: model {len(whole.params)} params "
        f"({human_bytes(whole.param_bytes())}), {_count(len(whole.aliases), 'tied name')}, "
        f"{_count(len(whole.buffers), 'buffer')}; "
        f"optimizer {optim}; extra of rank {whole.rank}; {human_bytes(size)}"
    ]


def _consolidate_whole_file(opened: Any, args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.staged import write_file
    from fsdp_optim.offline.operations import whole_file_state

    out = whole_file_state(opened, rank=args.rank, with_model=False if args.no_model else None)
    size = write_file(out, args.output, inputs=(args.directory, args.layout))
    what = "the optimizer's full dict" if args.no_model else "{'model', 'optimizer', 'extra'}"
    return [f"wrote {args.output}: {what} of {opened.label}, {human_bytes(size)}"]


def run_reshard(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.formats.fairseq.recut import reshard_set
    from fsdp_optim.formats.sharded.reader import read_manifest
    from fsdp_optim.offline.operations import reshard_opened

    out = Path(args.output)
    with _open(args, args.source, target=True) as opened, progress_bar(f"reshard -> {args.world_size} ranks") as bar:
        if opened.shards is not None:
            written = reshard_set(opened.shards, args.world_size, out, overwrite=args.overwrite, progress=bar)
            size = human_bytes(sum(f.stat().st_size for f in written))
            return [f"wrote {out}: {len(written)} shard files {written[0].name} .. {written[-1].name}, {size}"]
        # A checkpoint already in -o is replaced only with --overwrite (the API replaces it atomically).
        manifest = reshard_opened(
            opened, args.world_size, out, layout=args.layout, given=args.source, progress=bar,
            overwrite=args.overwrite, replace_existing=False, after_file=getattr(args, "after_file", None),
            buffers=args.buffers,
        )
    resharded = read_manifest(manifest)
    files = resharded.files
    line = f"wrote {out}: {len(files)} rank files, {human_bytes(sum(f.nbytes for f in files))}"
    if resharded.training is not None:  # a whole checkpoint: weights in the rank files, side files carried
        sides = resharded.training.files
        line += f" (weights included), {len(sides)} side files, {human_bytes(sum(f.nbytes for f in sides))}"
    return [line]



def run_convert(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.staged import write_file
    from fsdp_optim.formats.fairscale import to_named
    from fsdp_optim.offline.operations import full_state

    if args.max_shard_size is not None and args.to != "safetensors":
        raise ValueError(f"max_shard_size: applies to --to safetensors (of a whole checkpoint), not --to {args.to}")
    with _open(args, args.source) as opened:
        origin = opened.kind.value
        if args.to == "safetensors":
            return _to_safetensors(opened, args, origin)
        if args.to == "dcp":
            return _to_dcp(opened, args, origin)
        if opened.is_full_dict():
            if args.to == "full" and args.param_names is None:  # a plain dict named is a full dict made
                raise ValueError(f"{args.source}: already a full dict; use --to named to key it by parameter name")
            full = opened.full
        else:
            with progress_bar("consolidate") as progress:
                full = full_state(opened, progress=progress)
        result = to_named(full) if args.to == "named" else full
        size = write_file(result, args.output, inputs=(args.source, args.layout), overwrite=args.overwrite)
    return [f"wrote {args.output} ({args.to}, from a {origin}): {human_bytes(size)}"]



def _to_safetensors(opened: Any, args: argparse.Namespace, origin: str) -> list[str]:
    """``--to safetensors``: one named safetensors file (``<param name>/<state key>`` tensors) of any source."""
    from fsdp_optim.offline.named import write_opened
    from fsdp_optim.offline.whole import is_whole

    with progress_bar("write safetensors") as progress:
        size = write_opened(opened, args.output, inputs=(args.source, args.layout), progress=progress, path=args.source,
                            max_shard_size=args.max_shard_size, overwrite=args.overwrite)  # fmt: skip
    if is_whole(opened.checkpoint):
        names = ", ".join(sorted(p.name for p in Path(args.output).iterdir()))
        return [f"wrote {args.output} (safetensors: the model as Hugging Face stores it, the optimizer by parameter "
                f"name; from a whole {origin}): {names}; {human_bytes(size)}"]  # fmt: skip
    return [f"wrote {args.output} (safetensors, by parameter name, from a {origin}): {human_bytes(size)}"]



def _to_dcp(opened: Any, args: argparse.Namespace, origin: str) -> list[str]:
    from fsdp_optim.offline.export import export_opened

    with progress_bar("export to DCP") as progress:
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
