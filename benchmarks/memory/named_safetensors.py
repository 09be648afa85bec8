"""A full optimizer state to one named safetensors file and back (``python -m benchmarks.memory named_safetensors``).

A synthetic Adam full dict (``LAYERS`` x ``DIM``^2 fp32: 1.44 GiB at 46 layers), written once with ``torch.save``.
Each row runs once in a fresh interpreter, its peak RSS growth taken with its result alive: ours
(``to_safetensors`` from the dict file, ``load_full_state`` of the result); the naive peer (``torch.load`` whole,
then ``safetensors.torch.save_file`` of its ``<name>/<key>`` tensors; ``load_file``, which maps the file and reads
nothing yet); the floor a user has today, ``torch.save`` (after an untimed load) / ``torch.load`` of the same dict.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..peak import MiB, adam_full_dict, fresh, layers, measured

LAYERS, DIM = 46, 2048  # 192.9M parameters: Adam state 1.44 GiB in fp32
OPS = ["torch.save", "naive convert", "ours convert", "torch.load", "safetensors load_file*", "ours load_full_state"]


def _named(full: dict[str, Any]) -> dict[str, Any]:
    return {f"{full['param_names'][pid]}/{k}": v for pid, e in full["state"].items() for k, v in e.items()}


def measure(op: str, work: str, count: str = "") -> dict[str, Any]:
    """One row (or ``make``: the dict file), in a fresh interpreter."""
    import torch
    from safetensors.torch import load_file, save_file

    from fsdp_optim import load_full_state, to_safetensors

    w = Path(work)
    if op == "make":  # in a process of its own: it holds the whole dict
        torch.save(adam_full_dict(layers(int(count), DIM), 8, eps=1e-8, weight_decay=0.0), w / "full.pt")
        return {"op": op}
    pre: Any = torch.load(w / "full.pt", weights_only=True) if op == "torch.save" else None
    operations = {
        "torch.save": lambda: torch.save(pre, w / "copy.pt"),
        "naive convert": lambda: save_file(_named(torch.load(w / "full.pt", weights_only=True)), w / "naive.safetensors"),
        "ours convert": lambda: to_safetensors(w / "full.pt", w / "ours.safetensors"),
        "torch.load": lambda: torch.load(w / "full.pt", weights_only=True),
        "safetensors load_file*": lambda: load_file(w / "naive.safetensors"),
        "ours load_full_state": lambda: load_full_state(w / "ours.safetensors"),
    }
    seconds, growth, result = measured(operations[op])
    return {"op": op, "seconds": seconds, "peak_growth": growth, "alive": result is not None}


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    count = args.layers or (2 if args.small else LAYERS)
    state_bytes = count * (2 * DIM * DIM * 4 + 4)  # exp_avg, exp_avg_sq, step per parameter
    if not (work / "full.pt").exists():
        fresh("benchmarks.memory", "named_safetensors", "make", work, count)
    rows = [fresh("benchmarks.memory", "named_safetensors", op, work) for op in OPS]
    by_op = {r["op"]: r for r in rows}
    sizes = {name: (work / name).stat().st_size for name in ("full.pt", "ours.safetensors", "naive.safetensors")}
    print(f"state: {count} params of {DIM}x{DIM} fp32, Adam: {state_bytes / MiB:,.0f} MiB of tensors")
    print(f"files: full.pt {sizes['full.pt'] / MiB:,.1f} MiB, ours {sizes['ours.safetensors'] / MiB:,.1f} MiB, naive {sizes['naive.safetensors'] / MiB:,.1f} MiB")
    print(f"{'operation':<22} {'seconds':>8} {'x torch':>8} {'peak RSS growth MiB':>20} {'/ state':>8}")
    for r in rows:
        ratio = r["seconds"] / by_op["torch.load" if "load" in r["op"] else "torch.save"]["seconds"]
        print(f"{r['op']:<22} {r['seconds']:>8.2f} {ratio:>8.2f} {r['peak_growth'] / MiB:>20,.0f} {r['peak_growth'] / state_bytes:>8.2f}")
    print("* load_file maps the file and reads no tensor byte until used (no copy, no check): not a like-for-like row")
    print("  ours convert fsyncs its file before renaming it into place; torch.save and save_file do not")
    return {"layers": count, "dim": DIM, "state_bytes": state_bytes, "files": sizes, "runs": rows}
