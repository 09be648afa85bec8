"""``fsdp-optim list ROOT``: the step directories of a :class:`fsdp_optim.CheckpointManager` root, one line each.

    step 12  torn: no manifest: a save that did not finish (4 files: optim-..., ...)   world size ?   -        9.1 KiB
    step 10  damaged: optim-...-rank00001-of-00002.safetensors: chunk 0 ... checksum   world size 2   model+Adam ...
    step  8  complete                                                               world size 2   model+Adam ...

Every file of every step is verified (what ``fsdp-optim verify`` reads), unless ``--quick`` (sizes only). Exits 0
whatever the steps' states: it reports, it does not judge (``verify`` exits 1 on damage).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_optim.cli.inspect import human_bytes

if TYPE_CHECKING:
    from fsdp_optim.formats.sharded.steps import StepDir

__all__ = ["run_list"]


def run_list(args: argparse.Namespace) -> list[str]:
    from fsdp_optim.disk.locations import where
    from fsdp_optim.formats.sharded.steps import find_step_dirs, survey_step

    root = where(args.root)  # a local directory, or a prefix of an object store
    if isinstance(root, Path) and not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (expected a CheckpointManager's root)")
    found = [survey_step(step, path, verify=not args.quick) for step, path in find_step_dirs(root)]
    if args.json:
        return [json.dumps({"root": str(root), "steps": [_record(d) for d in found]})]
    if not found:
        return [f"{root}: no step directories (step-NNNNNNNN)"]
    width = len(str(max(d.step for d in found)))
    return [_line(d, width) for d in found]


def _holds(d: StepDir) -> str:
    parts = (["model"] if d.model else []) + ([f"optimizer ({d.optimizer})"] if d.optimizer else [])
    return " + ".join(parts) or "-"


def _line(d: StepDir, width: int) -> str:
    state = d.state if not d.reason else f"{d.state}: {d.reason}"
    world = d.world_size if d.world_size is not None else "?"
    foreign = f"; not ours: {', '.join(d.foreign)}" if d.foreign else ""
    return f"step {d.step:>{width}}  {state}  world size {world}  holds {_holds(d)}  {human_bytes(d.nbytes)}{foreign}"


def _record(d: StepDir) -> dict[str, Any]:
    return {
        "step": d.step,
        "path": str(d.path),
        "state": d.state,
        "reason": d.reason,
        "world_size": d.world_size,
        "model": d.model,
        "optimizer": d.optimizer,
        "bytes": d.nbytes,
        "foreign": list(d.foreign),
    }
