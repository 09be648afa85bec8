"""The benchmark's S3 server: the tests' SeaweedFS starter (``tests/_s3.py``) and counting proxy
(``tests/_fault_proxy.py``), imported from ``tests/`` (the proxy imports ``_s3`` as a top-level module, so ``tests/``
goes on ``sys.path``).

The server's data directory is chosen by the caller (tmpfs by default, so the time is the server's and the client's,
not a disk's). SeaweedFS keeps deleted and overwritten objects' bytes in its volumes until a vacuum, so
:func:`vacuum` asks the master to compact them between phases (every save of the benchmark replaces the one before).
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from _fault_proxy import FaultProxy  # noqa: E402
from _s3 import S3Endpoint, S3Server, start_server  # noqa: E402


def start(root: Path) -> S3Server:
    """``weed mini`` with its data under ``root``, one bucket, ready to serve."""
    return start_server(root, bucket="bench")


def counting_proxy(endpoint: S3Endpoint) -> FaultProxy:
    """A proxy in front of ``endpoint`` that injects nothing and counts the body bytes of every request and response."""
    return FaultProxy(endpoint).start()


def vacuum(server: S3Server) -> None:
    """Compact the volumes: the bytes of deleted and replaced objects go back (best effort)."""
    url = f"http://127.0.0.1:{server.ports['master.port']}/vol/vacuum?garbageThreshold=0.001"
    try:
        urllib.request.urlopen(url, timeout=120).read()
    except OSError as exc:
        print(f"(vacuum failed: {exc})", flush=True)


def get_bytes(stats: Any) -> int:
    """Response body bytes of GETs (object reads and listings) the proxy sent to its clients."""
    return int(stats.response_bytes.get("GET", 0))


__all__ = ["FaultProxy", "S3Endpoint", "S3Server", "counting_proxy", "get_bytes", "start", "vacuum"]
