"""Peak memory of offline consolidation and resharding against the checkpoint's size (``python -m benchmarks.memory
checkpoint``).

A spawned gloo job trains one Adam step on ``UNITS`` FSDP units of Linear(DIM, DIM) at ``WORLD_SIZE`` ranks and saves
a sharded checkpoint. Each row runs in a fresh interpreter with no process group, its peak RSS growth taken with its
result alive (the touched pages of mapped rank files count, so the ``max_mapped_bytes`` bound shows); ``naive``
loads every rank file whole and assembles, as a simple consolidation script does.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from ..peak import MiB, fresh, measured, spawn_gloo

UNITS, DIM, WORLD_SIZE = 16, 1024, 4  # 16.8M parameters: Adam state of 2 x 67 MB


def _job(rank: int, world_size: int, directory: str, units: int, dim: int) -> None:
    import torch
    from torch import nn

    from fsdp_optim import FullyShardedDataParallel as FSDP
    from fsdp_optim import save_sharded_optim_state

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[FSDP(nn.Linear(dim, dim)) for _ in range(units)]))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).sum().backward()
    optim.step()
    save_sharded_optim_state(model, optim, directory)


def measure(op: str, directory: str, limit: str) -> dict[str, Any]:
    """One row, in a fresh interpreter."""
    from fsdp_optim import consolidate, reshard
    from fsdp_optim.core.flatten import assemble
    from fsdp_optim.formats.sharded.reader import open_checkpoint

    def naive() -> dict:  # every rank file read whole into memory, then assembled
        with open_checkpoint(directory, lazy=True) as ckpt:
            manifest = ckpt.manifest
            files = [ckpt.load_rank(f.rank) for f in manifest.files]
        layout = manifest.layout(0)
        return {
            i: {e.key: assemble(layout.flat_params[i], [f[i][e.key] for f in files]) for e in rec.state if e.dtype}
            for i, rec in enumerate(manifest.flat_params)
            if rec.state
        }

    operations = {
        "consolidate": lambda: consolidate(directory, max_mapped_bytes=int(limit)),
        "reshard": lambda: reshard(directory, 3, tempfile.mkdtemp(), max_mapped_bytes=int(limit)),
        "naive": naive,
    }
    _, growth, result = measured(operations[op])
    return {"op": op, "limit": int(limit), "peak_growth": growth, "alive": result is not None}


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from fsdp_optim.formats.sharded.locate import is_sharded_checkpoint, read_manifest
    from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES

    directory = work / "ckpt"
    if not is_sharded_checkpoint(directory):
        spawn_gloo(_job, WORLD_SIZE, str(directory), args.layers or (4 if args.small else UNITS), 256 if args.small else DIM)
    manifest = read_manifest(directory)
    checkpoint = sum(f.nbytes for f in manifest.files)
    full = manifest.state_bytes()
    runs = [("naive", 0), ("consolidate", 1 << 62), ("consolidate", DEFAULT_MAPPED_BYTES), ("consolidate", 16 * MiB),
            ("reshard", DEFAULT_MAPPED_BYTES), ("reshard", 16 * MiB)]  # fmt: skip
    rows = [fresh("benchmarks.memory", "checkpoint", op, directory, limit) for op, limit in runs]
    print(f"checkpoint: {WORLD_SIZE} rank files, {checkpoint / MiB:.1f} MiB on disk; full dict {full / MiB:.1f} MiB")
    print(f"{'operation':<12} {'max_mapped_bytes':>17} {'peak RSS growth':>16} {'/ checkpoint':>13} {'/ full dict':>12}")
    for row in rows:
        limit = "-" if row["op"] == "naive" else ("unbounded" if row["limit"] >= 1 << 62 else f"{row['limit'] // MiB} MiB")
        growth = row["peak_growth"]
        print(f"{row['op']:<12} {limit:>17} {growth / MiB:>12.1f} MiB {growth / checkpoint:>13.2f} {growth / full:>12.2f}")
    return {"checkpoint_bytes": checkpoint, "full_dict_bytes": full, "world_size": WORLD_SIZE, "runs": rows}
