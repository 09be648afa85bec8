"""``python -m benchmarks.gpu.d2h [--gib N] [--repeats R]``: device-to-host copy speed of N GiB (default 1) into
three kinds of host memory, the ones a checkpoint's staging can use:

- ``registered``: an ordinary allocation page-locked afterwards with ``cudaHostRegister`` (what the staging arena
  of ``fsdp_optim.job.staging`` is); the registration's own seconds are reported beside it;
- ``pinned``: ``torch.empty(..., pin_memory=True)`` (CUDA's host allocator);
- ``pageable``: an ordinary allocation, touched first so that page faults are not timed.

One untimed copy, then ``R`` timed ones (``copy_(non_blocking=True)`` and a synchronize); the median in GB/s
(1e9 bytes per second). Prints a table and one JSON line (``{"rows": [...]}``) last. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

GiB = 1 << 30


def _register(buffer: torch.Tensor) -> float:
    """Page-lock ``buffer`` as the staging arena is; the seconds it took."""
    start = time.perf_counter()
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    seconds = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.numel()} bytes failed with CUDA error {code}")
    return seconds


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> list[float]:
    dst.copy_(src, non_blocking=True)  # untimed: the first copy maps what it must
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """One row per kind of host memory: its median seconds and GB/s, and the setup's seconds; or the error that
    kind met (a registration the machine refuses, say), the other kinds measured all the same."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    rows = []
    for kind in ("registered", "pinned", "pageable"):
        try:
            rows.append(_row(kind, src, repeats))
        except RuntimeError as exc:
            rows.append({"memory": kind, "bytes": nbytes, "error": str(exc)})
    return rows


def _row(kind: str, src: torch.Tensor, repeats: int) -> dict[str, Any]:
    """``src`` copied into host memory of ``kind``, ``repeats`` times timed; checked to have landed."""
    nbytes = src.numel()
    start = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
    if kind != "pinned":
        host.fill_(0)  # touch every page: the copy is timed, not the first faults
    setup = time.perf_counter() - start
    register = _register(host) if kind == "registered" else None
    try:
        times = _timed_copies(host, src, repeats)
        if not bool((host[:: 1 << 20] == 7).all()):
            raise RuntimeError(f"the {kind} copy did not land: read back differs")
    finally:
        if register is not None:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    median = statistics.median(times)
    return {"memory": kind, "bytes": nbytes, "seconds": median, "GB/s": nbytes / median / 1e9, "runs": times,
            "allocate_s": setup, "register_s": register}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.d2h", description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes to copy, in GiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed copies after the untimed one")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu.d2h: needs a CUDA device, none here", file=sys.stderr)
        return 2
    rows = measure(int(args.gib * GiB), args.repeats)
    print(f"device-to-host copy of {args.gib:g} GiB on {torch.cuda.get_device_name(0)}, median of {args.repeats}:")
    for r in rows:
        if "error" in r:
            print(f"  {r['memory']:<10} FAILED: {r['error']}")
            continue
        extra = f", cudaHostRegister {r['register_s'] * 1e3:.0f} ms" if r["register_s"] is not None else ""
        print(f"  {r['memory']:<10} {r['GB/s']:7.1f} GB/s  ({r['seconds'] * 1e3:.1f} ms; allocate {r['allocate_s'] * 1e3:.0f} ms{extra})")
    print(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}), flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
