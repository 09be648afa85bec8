"""``python -m benchmarks.offline_parallel.worker REPORT VERB ...``: ``fsdp-optim VERB ...`` in this process (one of
``torchrun``'s, or alone), then its wall time and peak RSS (``VmHWM``, mapped pages included) written to
``REPORT.<RANK>``; exits with the verb's code."""

from __future__ import annotations

import json
import os
import sys
import time

from ..peak import status_bytes


def main() -> int:
    start = time.perf_counter()
    from fsdp_optim.cli import main as cli

    code = cli(sys.argv[2:])
    rank = os.environ.get("RANK", "0")
    report = {"rank": int(rank), "seconds": time.perf_counter() - start, "peak_rss": status_bytes("VmHWM"), "code": code}
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump(report, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
