"""Peak memory of offline consolidation and resharding, against the size of the checkpoint.

    python -m benchmarks.checkpoint_memory [--workdir DIR] [--json FILE]

A spawned gloo job (CPU) trains one Adam step on UNITS FSDP units of Linear(DIM, DIM) at WORLD_SIZE
ranks and saves a sharded checkpoint. Each measurement then runs in a fresh interpreter with no process
group: after imports, ``malloc_trim`` and a peak-RSS reset (Linux: ``5`` into ``/proc/self/clear_refs``),
it runs one operation and reports VmHWM minus the VmRSS before it, with the result still alive. RSS
counts the pages of memory-mapped rank files that were touched, so the ``max_mapped_bytes`` bound is
visible in the numbers. The naive baseline loads every rank file whole and concatenates, which is what
a simple consolidation script does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from .peak import MiB, fresh, measured, reply, spawn_gloo

UNITS, DIM, WORLD_SIZE = 16, 1024, 4  # 16.8M parameters: Adam state of 2 x 67 MB


def _job(rank: int, world_size: int, directory: str) -> None:
    import torch
    from torch import nn

    from fsdp_optim import FullyShardedDataParallel as FSDP
    from fsdp_optim import save_sharded_optim_state

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[FSDP(nn.Linear(DIM, DIM)) for _ in range(UNITS)]))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, DIM)).sum().backward()
    optim.step()
    save_sharded_optim_state(model, optim, directory)




def _measure(op: str, directory: str, limit: int) -> None:
    """Runs in a fresh interpreter; prints one JSON line."""

    from fsdp_optim import consolidate, reshard
    from fsdp_optim.core.flatten import assemble
    from fsdp_optim.formats.sharded.reader import ShardedCheckpoint

    def naive() -> dict:  # every rank file read whole into memory, then assembled
        with ShardedCheckpoint(directory, lazy=True) as ckpt:
            manifest = ckpt.manifest
            files = [ckpt.load_rank(f.rank) for f in manifest.files]
        layout = manifest.layout(0)
        return {
            i: {e.key: assemble(layout.flat_params[i], [f[i][e.key] for f in files]) for e in rec.state if e.dtype}
            for i, rec in enumerate(manifest.flat_params)
            if rec.state
        }

    operations = {
        "consolidate": lambda: consolidate(directory, max_mapped_bytes=limit),
        "reshard": lambda: reshard(directory, 3, tempfile.mkdtemp(), max_mapped_bytes=limit),
        "naive": naive,
    }
    _, growth, result = measured(operations[op])
    reply(op=op, limit=limit, peak_growth=growth, alive=result is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", nargs=3, metavar=("OP", "DIR", "LIMIT"), help=argparse.SUPPRESS)  # run by fresh()
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure[0], args.measure[1], int(args.measure[2]))
        return

    from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES, is_sharded_checkpoint, read_manifest

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt_mem_"))
    directory = workdir / "ckpt"
    if not is_sharded_checkpoint(directory):
        spawn_gloo(_job, WORLD_SIZE, str(directory))
    manifest = read_manifest(directory)
    checkpoint = sum(f.nbytes for f in manifest.files)
    full = manifest.state_bytes()
    runs = [("naive", 0), ("consolidate", 1 << 62), ("consolidate", DEFAULT_MAPPED_BYTES), ("consolidate", 16 * MiB),
            ("reshard", DEFAULT_MAPPED_BYTES), ("reshard", 16 * MiB)]
    rows = [fresh("benchmarks.checkpoint_memory", op, directory, limit) for op, limit in runs]
    print(f"checkpoint: {WORLD_SIZE} rank files, {checkpoint / MiB:.1f} MiB on disk; full dict {full / MiB:.1f} MiB")
    print(f"{'operation':<12} {'max_mapped_bytes':>17} {'peak RSS growth':>16} {'/ checkpoint':>13} {'/ full dict':>12}")
    for row in rows:
        limit = "-" if row["op"] == "naive" else ("unbounded" if row["limit"] >= 1 << 62 else f"{row['limit'] // MiB} MiB")
        growth = row["peak_growth"]
        print(f"{row['op']:<12} {limit:>17} {growth / MiB:>12.1f} MiB {growth / checkpoint:>13.2f} {growth / full:>12.2f}")
    report = {"checkpoint_bytes": checkpoint, "full_dict_bytes": full, "world_size": WORLD_SIZE, "runs": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
