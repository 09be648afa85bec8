"""Peak resident memory of one operation run in this process, from ``/proc/self/status``.

``measured(fn)`` collects garbage, trims malloc's free lists, resets the high-water mark (``clear_refs`` 5),
runs ``fn`` and returns ``(seconds, peak RSS growth in bytes, fn's result)``: the growth is ``VmHWM`` after
minus ``VmRSS`` before, so one operation's memory never hides another's when each runs in a process (or
forked child) of its own. Linux only; imports no torch.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["measured", "status_bytes"]


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (``VmRSS``: resident now, ``VmHWM``: peak since the reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Collect garbage, return free memory to the system, reset the peak; the resident bytes now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def measured(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """``fn()`` timed, with its peak RSS growth: ``(seconds, bytes, result)``."""
    before = reset_peak()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return seconds, status_bytes("VmHWM") - before, result
