"""Converting a full optimizer state to one named safetensors file and back: peak memory and time against peers.

    python benchmarks/named_safetensors.py [--layers N] [--workdir DIR] [--json FILE]

A synthetic Adam full dict (``LAYERS`` parameters of ``DIM x DIM`` fp32, each with ``exp_avg``, ``exp_avg_sq``
and a 0-dim ``step``: 2 x 8 x 2048^2 x 4 B = 1.5 GiB at the default 46 layers) is written once with ``torch.save``.
Each operation then runs in a fresh interpreter: after imports, ``malloc_trim`` and a peak-RSS reset (Linux:
``5`` into ``/proc/self/clear_refs``) it runs once and reports its wall time and VmHWM minus the VmRSS before it
(RSS counts the touched pages of memory-mapped files too), with its result still alive.

Rows: ours (``to_safetensors`` from the full dict file, ``load_full_state`` of the result); the naive peer
(``torch.load`` the dict whole, then ``safetensors.torch.save_file`` of its ``<name>/<key>`` tensors; loading
with ``safetensors.torch.load_file``, which maps the file and reads nothing yet); and the floor a user has today, ``torch.save`` / ``torch.load`` of the
same dict (the save timed after an untimed ``torch.load``, its RSS growth counted from there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .peak import measured

LAYERS, DIM = 46, 2048  # 192.9M parameters: Adam state 1.44 GiB in fp32
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
OPS = ["torch.save", "naive convert", "ours convert", "torch.load", "safetensors load_file*", "ours load_full_state"]




def _make(path: Path, layers: int) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    state = {
        i: {"step": torch.tensor(7.0), "exp_avg": torch.randn(DIM, DIM, generator=g), "exp_avg_sq": torch.rand(DIM, DIM, generator=g)}
        for i in range(layers)
    }
    full = {
        "state": state,
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(layers))}],
        "param_names": {i: f"layers.{i}.weight" for i in range(layers)},
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 8, "scalar_keys": ["step"]},
    }
    torch.save(full, path)


def _named(full: dict[str, Any]) -> dict[str, Any]:
    return {f"{full['param_names'][pid]}/{k}": v for pid, e in full["state"].items() for k, v in e.items()}


def _measure(op: str, work: str) -> None:
    """Runs in a fresh interpreter; prints one JSON line."""
    import torch
    from safetensors.torch import load_file, save_file

    from fsdp_optim import load_full_state, to_safetensors

    w = Path(work)
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
    print(json.dumps({"op": op, "seconds": seconds, "peak_growth": growth, "alive": result is not None}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", nargs=2, metavar=("OP", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _measure(*args.measure)
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="named_st_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    state_bytes = args.layers * (2 * DIM * DIM * 4 + 4)  # exp_avg, exp_avg_sq, step per parameter
    if not (work / "full.pt").exists():  # made once, in a process of its own (it holds the whole dict)
        code = f"from benchmarks.named_safetensors import _make; from pathlib import Path; _make(Path({str(work / 'full.pt')!r}), {args.layers})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)
    rows = []
    for op in OPS:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", op, str(work)], capture_output=True, text=True, env=env, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by_op = {r["op"]: r for r in rows}
    floor = {"convert": by_op["torch.save"], "load": by_op["torch.load"]}
    sizes = {name: (work / name).stat().st_size for name in ("full.pt", "ours.safetensors", "naive.safetensors")}
    print(f"state: {args.layers} params of {DIM}x{DIM} fp32, Adam: {state_bytes / MiB:,.0f} MiB of tensors")
    print(f"files: full.pt {sizes['full.pt'] / MiB:,.1f} MiB, ours {sizes['ours.safetensors'] / MiB:,.1f} MiB, "
          f"naive {sizes['naive.safetensors'] / MiB:,.1f} MiB")  # fmt: skip
    print(f"{'operation':<22} {'seconds':>8} {'x torch':>8} {'peak RSS growth MiB':>20} {'/ state':>8}")
    for r in rows:
        kind = "load" if "load" in r["op"] else "convert"
        ratio = r["seconds"] / floor[kind]["seconds"]
        growth = r["peak_growth"]
        print(f"{r['op']:<22} {r['seconds']:>8.2f} {ratio:>8.2f} {growth / MiB:>20,.0f} {growth / state_bytes:>8.2f}")
    print("* load_file maps the file and reads no tensor byte until used (no copy, no check): not a like-for-like row")
    print("  ours convert fsyncs its file before renaming it into place; torch.save and save_file do not")
    report = {"layers": args.layers, "dim": DIM, "state_bytes": state_bytes, "files": sizes, "runs": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
