"""Whether ``torchrun`` (or a launcher like it) started this process as one of several: read from the environment
alone, so that a command run without it imports nothing that talks to ``torch.distributed``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["launched"]


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or a launcher like it) as one of several: ``RANK`` and a
    ``WORLD_SIZE`` over 1 in its environment, and not merely inherited from its parent (a training job's rank that
    runs ``fsdp-optim`` as a command passes its own on; the command then runs alone, as ``FSDP_OPTIM_ALONE=1`` also
    asks)."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("FSDP_OPTIM_ALONE"):
        return False
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:  # no /proc: trust the environment
        return True
    return not any(v.startswith(b"RANK=") for v in parent)
