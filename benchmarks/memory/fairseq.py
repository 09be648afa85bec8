"""Peak memory of resharding and exporting a fairseq/metaseq shard set (``python -m benchmarks.memory fairseq``).

A spawned gloo job of ``WORLD_SIZE`` ranks trains one Adam step of a ~100M-parameter model under our fairscale FSDP
(an embedding in the root unit, ``BLOCKS`` nested units of two linear layers) and writes each rank's file exactly as
metaseq does (``tests/_fairseq.checkpoint_dict``). Each row runs in a fresh interpreter with no process group:
``load_all`` (metaseq's ``scripts/reshard_fsdp.py``: every shard loaded whole, each unit concatenated and cut again
for ``TARGET`` ranks, each new file saved), ``reshard`` (``reshard_shards``, streamed), ``to_dcp`` and
``consolidate`` (``consolidate_shards(with_model=True)``, whose result is the whole state: for scale).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..peak import ROOT, MiB, fresh, measured, spawn_gloo

SIZES = (16000, 1024, 4096, 10)  # vocabulary, width, hidden, blocks: 16.4M in the root unit + 10 x 8.4M = 100.3M parameters
SMALL = (1000, 128, 256, 2)
WORLD_SIZE, TARGET = 4, 3
PREFIX = "checkpoint_1-model_part-0"


def _job(rank: int, world_size: int, directory: str, sizes: tuple[int, int, int, int]) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import _fairseq
    import torch
    from torch import nn

    from fsdp_optim import FullyShardedDataParallel as FSDP

    VOCAB, DIM, HIDDEN, BLOCKS = sizes  # noqa: N806
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


def measure(op: str, prefix: str, workdir: str) -> dict[str, Any]:
    """One row, in a fresh interpreter."""

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
    return {"op": op, "peak_growth": growth, "seconds": seconds, "written": written, "alive": result is not None}


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from fsdp_optim.fairseq import ShardSet

    prefix = workdir / "set" / PREFIX
    if not (prefix.parent / f"{PREFIX}-shard{WORLD_SIZE - 1}.pt").exists():
        spawn_gloo(_job, WORLD_SIZE, str(prefix.parent), SMALL if args.small else SIZES)
    checkpoint = sum(p.stat().st_size for p in prefix.parent.glob(f"{PREFIX}-shard*.pt"))
    with ShardSet(prefix) as shards:
        params = sum(f.numel for f in shards.manifest.flat_params)
        largest = max(f.numel for f in shards.manifest.flat_params)
        state_tensors = 1 + sum(1 for e in shards.manifest.flat_params[0].state if e.dtype)  # weights + exp_avg(_sq)
    unit_bytes = largest * 4 * state_tensors  # the largest unit's weights and state, fp32, whole
    rows = [fresh("benchmarks.memory", "fairseq", op, prefix, workdir) for op in ("load_all", "reshard", "to_dcp", "consolidate")]
    print(f"shard set: {WORLD_SIZE} files, {checkpoint / MiB:.1f} MiB on disk; {params / 1e6:.1f}M parameters; "
          f"largest unit {largest / 1e6:.1f}M parameters = {unit_bytes / MiB:.1f} MiB of weights + Adam state")
    print(f"{'operation':<12} {'peak RSS growth':>16} {'/ checkpoint':>13} {'/ largest unit':>15} {'seconds':>8}")
    for row in rows:
        growth = row["peak_growth"]
        print(f"{row['op']:<12} {growth / MiB:>12.1f} MiB {growth / checkpoint:>13.3f} {growth / unit_bytes:>15.2f} "
              f"{row['seconds']:>8.1f}")
    return {"checkpoint_bytes": checkpoint, "parameters": params, "largest_unit_parameters": largest, "largest_unit_bytes": unit_bytes,
            "world_size": WORLD_SIZE, "target_world_size": TARGET, "runs": rows}  # fmt: skip
