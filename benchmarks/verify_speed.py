"""Benchmark: ``fsdp_optim.verify`` of a sharded checkpoint against its floor, reading every rank file and hashing it
with xxh3 in 64 KiB chunks (the checksum verify checks), in one run.

    python -m benchmarks.verify_speed              # ~1 GB of Adam state in 8 rank files (issue 29: verify <= 1.5x)
    python -m benchmarks.verify_speed --gb 0.1     # a quick run

The checkpoint is written once (offline ``reshard`` of a synthetic full dict) under ``/dev/shm``; each measurement
runs in a forked child (time and peak RSS growth), methods interleaved, median of ``--repeats``. The page cache is
warm for both: this is the CPU cost of verifying, not the disk's. Prints a table and writes
``benchmarks/results/verify_speed.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import xxhash

from .peak import in_child
from .report import RESULTS
from .scale.ops import full_dict, layout

# ---- configuration ---------------------------------------------------------------------------------
GB = 1.0  # state bytes (exp_avg + exp_avg_sq, float32)
UNITS = 32
WORLD_SIZE = 8
REPEATS = 3
CHUNK = 64 << 10
# -----------------------------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.verify_speed", description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=GB)
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="fsdp_optim_verify_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        ckpt = _make(root, args.gb)
        files = sorted(ckpt.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        times: dict[str, list[float]] = {"floor": [], "verify": []}
        peaks: dict[str, list[int]] = {"floor": [], "verify": []}
        _floor(files)  # the page cache warm for both
        for _ in range(args.repeats):
            for name, fn in (("floor", lambda: _floor(files)), ("verify", lambda: _verify(ckpt))):
                seconds, peak, result = in_child(fn)
                assert result, f"{name} failed"
                times[name].append(seconds)
                peaks[name].append(peak)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        {"method": k, "median_s": med[k], "peak_rss_mib": max(peaks[k]) / 2**20, "x_floor": med[k] / med["floor"]}
        for k in times
    ]
    lines = [
        f"# verify speed: {size / 1e9:.2f} GB in {len(files)} rank files (command: python -m benchmarks.verify_speed"
        f"{' --gb ' + str(args.gb) if args.gb != GB else ''}), median of {args.repeats}, load {os.getloadavg()[0]:.1f}",
        "",
        "| method | median s | peak RSS growth MiB | x floor |",
        "|---|---|---|---|",
        *(f"| {r['method']} | {r['median_s']:.3f} | {r['peak_rss_mib']:.0f} | {r['x_floor']:.2f} |" for r in rows),
        "",
        f"Target (issue 29): verify <= 1.5x the floor: {'met' if med['verify'] <= 1.5 * med['floor'] else 'MISSED'}.",
    ]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify_speed.md").write_text("\n".join(lines) + "\n")
    (args.out / "verify_speed.json").write_text(json.dumps({"bytes": size, "files": len(files), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
