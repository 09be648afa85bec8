"""Offline consolidation of a whole checkpoint, no process group: ours (``consolidate`` + ``torch.save`` of the
``{"model", "optimizer", "extra"}`` dict) against DCP's ``dcp_to_torch_save`` of the same state saved by FSDP2.

Run in the parent process after a job, on the checkpoints that job left: methods interleaved, median of
``repeats`` calls after one warm-up, the output file written (fsynced) and removed after each call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..measure import Measurement
from ..peak import fsync_path, rounds


def measure(checkpoint: Path, dcp_dir: Path, scratch: Path, *, repeats: int) -> dict[str, Any]:
    """``{"whole_consolidate": Measurement, "dcp_consolidate": Measurement}`` (times only)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import fsdp_optim

    def fsynced(write: Callable[[Path], Any], out: Path) -> Callable[[], None]:
        return lambda: (write(out), fsync_path(out))  # type: ignore[func-returns-value]

    methods = {
        "whole_consolidate": fsynced(lambda out: torch.save(fsdp_optim.consolidate(checkpoint), out), scratch / "whole_consolidate.pt"),
        "dcp_consolidate": fsynced(lambda out: dcp_to_torch_save(str(dcp_dir), str(out)), scratch / "dcp_consolidate.pt"),
    }
    times = rounds(methods, warmup=1, repeats=repeats, rotate=False, after=lambda name: (scratch / f"{name}.pt").unlink())
    return {name: Measurement(t, 0, None, None, note="offline, one process") for name, t in times.items()}
