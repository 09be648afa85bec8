"""Peak memory of resharding and exporting a fairseq/metaseq shard set, against a load-everything baseline.

    python -m benchmarks.fairseq_memory [--workdir DIR] [--json FILE]

A spawned gloo job (CPU) of WORLD_SIZE ranks trains one Adam step of a ~100M-parameter model under
fairscale FSDP (``fsdp_optim.FullyShardedDataParallel``: an embedding in the root unit, BLOCKS nested units of
two linear layers) and writes each rank's file exactly as metaseq does (``tests/_fairseq.checkpoint_dict``:
``model`` = ``local_state_dict()``, ``last_optimizer_state`` with ``loss_scale``, ``shard_metadata``, cfg, ...).

Each measurement then runs in a fresh interpreter with no process group: after imports, ``malloc_trim`` and
a peak-RSS reset (Linux: ``5`` into ``/proc/self/clear_refs``) it runs one operation and reports VmHWM minus
the VmRSS before it. RSS counts the touched pages of memory-mapped files, so the mapping bound shows.

- ``load_all``: what metaseq's ``scripts/reshard_fsdp.py`` does: ``torch.load`` every shard whole, then for
  every unit concatenate the unpadded shards of the weights and of each optimizer state and cut them again
  for TARGET ranks, ``torch.save`` each new file;
- ``reshard``: ``fsdp_optim.fairseq.reshard_shards(set, TARGET, out)`` (streamed, one tensor at a time);
- ``to_dcp``: ``fsdp_optim.to_dcp(set, out)`` (weights and optimizer state, one tensor at a time);
- ``consolidate``: ``consolidate_shards(set, with_model=True)``, whose result is the whole state (for scale).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .peak import measured

VOCAB, DIM, HIDDEN, BLOCKS = 16000, 1024, 4096, 10  # 16.4M in the root unit + 10 x 8.4M = 100.3M parameters
WORLD_SIZE, TARGET = 4, 3
PREFIX = "checkpoint_1-model_part-0"
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def _job(rank: int, world_size: int, port: int, directory: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import _fairseq
    import torch
    import torch.distributed as dist
    from torch import nn

    from fsdp_optim import FullyShardedDataParallel as FSDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.Sequential(
                *[FSDP(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM))) for _ in range(BLOCKS)]
            )

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.blocks(self.embed(tokens))

    model = FSDP(Net())
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randint(0, VOCAB, (2, 4))).sum().backward()
    optim.step()
    state = _fairseq.checkpoint_dict(model, optim, flavour="metaseq", num_updates=1, loss_scale=128.0)
    _fairseq.save_shard(state, Path(directory) / PREFIX, rank)
    dist.destroy_process_group()




def _load_all(prefix: Path, out: Path) -> None:
    """The baseline: every shard in memory at once, re-cut unit by unit, each new file saved whole."""
    import torch

    from fsdp_optim.core.layout import shard_bounds

    files = [torch.load(p, map_location="cpu", weights_only=False) for p in sorted(prefix.parent.glob(f"{prefix.name}-shard*.pt"))]
    meta = files[0]["shard_metadata"]
    outputs = [{**files[0], "model": dict(files[0]["model"])} for _ in range(TARGET)]
    for o in outputs:
        o["last_optimizer_state"] = {**files[0]["last_optimizer_state"], "state": {}}
        o["shard_metadata"] = json.loads(json.dumps(meta, default=list))
    for pid, (inst, (name, info)) in enumerate((i, p) for i in meta["param_metadata"] for p in i["params"].items()):
        key = ".".join(x for x in (inst["fsdp_path"], name) if x)
        numel = sum(info["numels"])

        def recut(tensors: list, numel: int = numel) -> list:
            whole = torch.cat([t[: shard_bounds(numel, WORLD_SIZE, r).real] for r, t in enumerate(tensors)])
            cuts = []
            for r in range(TARGET):
                b = shard_bounds(numel, TARGET, r)
                cuts.append(torch.cat([whole[b.start : b.stop], whole.new_zeros(b.padding)]))
            return cuts

        for r, t in enumerate(recut([f["model"][key] for f in files])):
            outputs[r]["model"][key] = t
        for state_key, value in files[0]["last_optimizer_state"]["state"][pid].items():
            cut = recut([f["last_optimizer_state"]["state"][pid][state_key] for f in files]) if value.dim() else None
            for r in range(TARGET):
                entry = outputs[r]["last_optimizer_state"]["state"].setdefault(pid, {})
                entry[state_key] = cut[r] if cut is not None else value
    out.mkdir(parents=True, exist_ok=True)
    for r, o in enumerate(outputs):
        torch.save(o, out / f"{prefix.name}-shard{r}.pt")


def _measure(op: str, prefix: str, workdir: str) -> None:
    """Runs in a fresh interpreter; prints one JSON line."""

    import torch  # noqa: F401 - imported before the measurement starts

    from fsdp_optim import to_dcp
    from fsdp_optim.fairseq import consolidate_shards, reshard_shards

    out = Path(tempfile.mkdtemp(dir=workdir)) / "out"
    operations = {
        "load_all": lambda: _load_all(Path(prefix), out),
        "reshard": lambda: reshard_shards(prefix, TARGET, out),
        "to_dcp": lambda: to_dcp(prefix, out),
        "consolidate": lambda: consolidate_shards(prefix, with_model=True),
    }
    seconds, growth, result = measured(operations[op])
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.exists() else 0
    shutil.rmtree(out.parent, ignore_errors=True)
    print(json.dumps({"op": op, "peak_growth": growth, "seconds": seconds, "written": written, "alive": result is not None}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", nargs=3, metavar=("OP", "PREFIX", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _measure(*args.measure)
        return

    import socket

    import torch.multiprocessing as mp

    from fsdp_optim.fairseq import ShardSet

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fairseq_mem_"))
    prefix = workdir / "set" / PREFIX
    if not (prefix.parent / f"{PREFIX}-shard{WORLD_SIZE - 1}.pt").exists():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_job, args=(WORLD_SIZE, port, str(prefix.parent)), nprocs=WORLD_SIZE, start_method="spawn")
    checkpoint = sum(p.stat().st_size for p in prefix.parent.glob(f"{PREFIX}-shard*.pt"))
    with ShardSet(prefix) as shards:
        params = sum(f.numel for f in shards.manifest.flat_params)
        largest = max(f.numel for f in shards.manifest.flat_params)
        state_tensors = 1 + sum(1 for e in shards.manifest.flat_params[0].state if e.dtype)  # weights + exp_avg(_sq)
    unit_bytes = largest * 4 * state_tensors  # the largest unit's weights and state, fp32, whole
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = []
    for op in ("load_all", "reshard", "to_dcp", "consolidate"):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.fairseq_memory", "--measure", op, str(prefix), str(workdir)],
            capture_output=True, text=True, env=env, check=True, cwd=ROOT,
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"shard set: {WORLD_SIZE} files, {checkpoint / MiB:.1f} MiB on disk; {params / 1e6:.1f}M parameters; "
          f"largest unit {largest / 1e6:.1f}M parameters = {unit_bytes / MiB:.1f} MiB of weights + Adam state")
    print(f"{'operation':<12} {'peak RSS growth':>16} {'/ checkpoint':>13} {'/ largest unit':>15} {'seconds':>8}")
    for row in rows:
        growth = row["peak_growth"]
        print(f"{row['op']:<12} {growth / MiB:>12.1f} MiB {growth / checkpoint:>13.3f} {growth / unit_bytes:>15.2f} "
              f"{row['seconds']:>8.1f}")
    report = {
        "checkpoint_bytes": checkpoint,
        "parameters": params,
        "largest_unit_parameters": largest,
        "largest_unit_bytes": unit_bytes,
        "world_size": WORLD_SIZE,
        "target_world_size": TARGET,
        "runs": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
