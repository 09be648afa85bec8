"""``python -m benchmarks.format2 --layout``: the rank-file header measurement behind format 3's one tensor per dtype
(cited in ``fsdp_optim/formats/sharded/segments.py``): safetensors' own writer, two float32 keys per unit, one file,
bytes beyond the payload with one tensor per (unit, key) and with one tensor per dtype.

This module once also compared format 1 (torch zip + pickle) with format 2 (JSON manifest + safetensors); both are
superseded by format 3 and that comparison was retired (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import safetensors.torch
import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.format2", description=__doc__.split("\n")[0])
    parser.add_argument("--layout", action="store_true", help="the only measurement left (the default)")
    parser.parse_args(argv)
    print(f"{'units':>6} {'payload':>10} | {'per (unit, key): header':>24} {'size/payload':>12} | {'per dtype: header':>17} {'size/payload':>12}")
    for units, numel in ((256, 512), (256, 8), (4096, 3200)):
        g = torch.Generator().manual_seed(0)
        tensors = {f"{i}/{k}": torch.randn(numel, generator=g) for i in range(units) for k in ("exp_avg", "exp_avg_sq")}
        payload = sum(t.numel() * 4 for t in tensors.values())
        with tempfile.TemporaryDirectory() as d:
            sizes = []
            for case in (tensors, {"float32": torch.cat(list(tensors.values()))}):
                path = Path(d) / "f.safetensors"
                safetensors.torch.save_file(case, path, metadata={"format": "fsdp_optim"})
                sizes.append(path.stat().st_size)
        print(f"{units:>6} {payload:>10} | {sizes[0] - payload:>24} {sizes[0] / payload:>12.4f} | {sizes[1] - payload:>17} {sizes[1] / payload:>12.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
