"""``fsdp_optim.verify`` of a sharded checkpoint against its floor (``python -m benchmarks.memory verify``): every rank
file read and hashed with xxh3 in 64 KiB chunks (the checksum verify checks). ~1 GB of Adam state in 8 rank files
(``reshard`` of a synthetic full dict, on tmpfs by default: the CPU cost alone); each row in a forked child (time, peak RSS growth), interleaved, median of ``--repeat``, the page cache
warm for both. Target: verify <= 1.5x the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

import xxhash

from ..peak import in_child
from ..scale.ops import full_dict, layout

TMPFS = True  # the work directory's default: /dev/shm
GB, SMALL_GB = 1.0, 0.02  # state bytes (exp_avg + exp_avg_sq, float32)
UNITS, WORLD_SIZE, REPEATS = 32, 8, 3
CHUNK = 64 << 10


def _floor(files: list[Path]) -> int:
    """Read every file and hash it in 64 KiB chunks: what verify cannot avoid."""
    total = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        view = memoryview(data)
        for at in range(0, len(view), CHUNK):
            xxhash.xxh3_128(view[at : at + CHUNK]).digest()
        total += len(data)
    return total


def _verify(directory: Path) -> bool:
    import fsdp_optim

    return fsdp_optim.verify(directory).ok


def _make(root: Path, gb: float) -> Path:
    import fsdp_optim

    per_unit = int(gb * 1e9 / 8 / UNITS)  # two float32 keys per element
    full = full_dict(layout(UNITS, 1, per_unit))
    out = root / "ckpt"
    fsdp_optim.reshard(full, WORLD_SIZE, out, layout=layout(UNITS, WORLD_SIZE, per_unit))
    return out


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    gb, repeats = SMALL_GB if args.small else GB, args.repeat or REPEATS
    ckpt = work / "ckpt" if (work / "ckpt").exists() else _make(work, gb)
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    times: dict[str, list[float]] = {"floor": [], "verify": []}
    peaks: dict[str, list[int]] = {"floor": [], "verify": []}
    _floor(files)  # the page cache warm for both
    for _ in range(repeats):
        for name, fn in (("floor", lambda: _floor(files)), ("verify", lambda: _verify(ckpt))):
            seconds, peak, result = in_child(fn)
            assert result, f"{name} failed"
            times[name].append(seconds)
            peaks[name].append(peak)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"method": k, "median_s": med[k], "peak_rss_mib": max(peaks[k]) / 2**20, "x_floor": med[k] / med["floor"]} for k in times]
    print(f"verify speed: {size / 1e9:.2f} GB in {len(files)} rank files, median of {repeats}, load {os.getloadavg()[0]:.1f}")
    print("| method | median s | peak RSS growth MiB | x floor |", "|---|---|---|---|", sep="\n")
    print("\n".join(f"| {r['method']} | {r['median_s']:.3f} | {r['peak_rss_mib']:.0f} | {r['x_floor']:.2f} |" for r in rows))
    print(f"Target: verify <= 1.5x the floor: {'met' if med['verify'] <= 1.5 * med['floor'] else 'MISSED'}.")
    return {"bytes": size, "files": len(files), "rows": rows}
