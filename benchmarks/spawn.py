"""Start ``world_size`` fresh processes on one process group and bring every rank's result back.

The benchmark uses the tests' spawn helper (``tests/_dist.py``: one helper for every multi-process program
in this repository) with long timeouts, the backend chosen by the caller, deprecation notices silenced
in the ranks, and one intra-op thread per rank (``OMP_NUM_THREADS=1`` is inherited through the
environment). Run from the repository root, where ``tests`` is importable.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from tests._dist import run_ranks as _run_ranks


def _quietly(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    warnings.filterwarnings("ignore")  # FSDP1 deprecation and DCP notices, once per rank, per call
    return fn(rank, world_size, *args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    collective_timeout_s: float = 300,
    deadline_s: float = 1800,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return every rank's result.

    Raises ``RuntimeError`` with each failing rank's traceback, or when the deadline passes (ranks killed).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        return _run_ranks(
            _quietly, world_size, fn, *args, deadline_s=deadline_s, timeout_s=collective_timeout_s, backend=backend
        )
    except (AssertionError, TimeoutError) as exc:
        raise RuntimeError(f"world size {world_size}: {exc}") from exc
