"""Offline consolidation of a whole checkpoint, no process group: ours (``consolidate`` + ``torch.save`` of the
``{"model", "optimizer", "extra"}`` dict) against DCP's ``dcp_to_torch_save`` of the same state saved by FSDP2.

Run in the parent process after a job, on the checkpoints that job left: methods interleaved, median of
``repeats`` calls after one warm-up, the output file written (fsynced) and removed after each call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..measure import Measurement


def _timed(call: Callable[[Path], None], out: Path) -> float:
    start = time.perf_counter()
    call(out)
    with open(out, "rb") as f:
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    out.unlink()
    return elapsed


def measure(checkpoint: Path, dcp_dir: Path, scratch: Path, *, repeats: int) -> dict[str, Any]:
    """``{"whole_consolidate": Measurement, "dcp_consolidate": Measurement}`` (times only)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import fsdp_optim

    def ours(out: Path) -> None:
        torch.save(fsdp_optim.consolidate(checkpoint), out)

    def dcp(out: Path) -> None:
        dcp_to_torch_save(str(dcp_dir), str(out))

    methods = {"whole_consolidate": ours, "dcp_consolidate": dcp}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, call in methods.items():
            elapsed = _timed(call, scratch / f"{name}.pt")
            if round_:
                times[name].append(elapsed)
    return {name: Measurement(t, 0, None, None, note="offline, one process") for name, t in times.items()}
