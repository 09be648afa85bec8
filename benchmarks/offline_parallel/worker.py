"""``python -m benchmarks.offline_parallel.worker REPORT VERB ...``: ``fsdp-optim VERB ...`` in this process (one of
``torchrun``'s, or alone), then its wall time and peak RSS (``VmHWM``, mapped pages included) written to
``REPORT.<RANK>``, with the scheduler's account of its live threads (``/proc/self/task/*/schedstat``: seconds on a
CPU and seconds runnable but waiting for one); exits with the verb's code."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..peak import status_bytes


def schedstat(tasks: str = "/proc/self/task") -> list[float]:
    """Seconds on a CPU and seconds waiting on a run queue, summed over the live threads of ``tasks``."""
    on_cpu = waiting = 0
    for task in Path(tasks).iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        on_cpu, waiting = on_cpu + int(fields[0]), waiting + int(fields[1])
    return [on_cpu / 1e9, waiting / 1e9]


def main() -> int:
    start = time.perf_counter()
    from fsdp_optim.cli import main as cli

    code = cli(sys.argv[2:])
    rank = os.environ.get("RANK", "0")
    report = {"rank": int(rank), "seconds": time.perf_counter() - start, "peak_rss": status_bytes("VmHWM"), "code": code,
              "schedstat": schedstat()}  # fmt: skip
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump(report, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
