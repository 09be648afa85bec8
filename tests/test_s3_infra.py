"""Tests of the object-storage test infrastructure itself (tests/_s3.py, tests/_fault_proxy.py), with plain s3fs.

They pin down what the library's S3 backend will meet: the server's conditional puts (412 on ``If-None-Match: *``
over an existing key and on a wrong ``If-Match``) and how s3fs/botocore report or retry each injected fault.
Recorded here (s3fs 2026.9.0, aiobotocore 3.10.0, SeaweedFS 4.48):

- a 412 reaches s3fs callers as ``OSError(EINVAL)`` whose ``__cause__`` is the botocore ``ClientError``
  (code ``PreconditionFailed``), not ``FileExistsError``: s3fs maps it to FileExistsError only when the error names
  ``<Condition>If-None-Match</Condition>``, which AWS sends and SeaweedFS does not;
- a single 503, 500, dropped connection or truncated body is retried inside s3fs/botocore and the call succeeds;
- with retries exhausted: a 503 is ``OSError(EBUSY)`` (cause ``ClientError`` ``SlowDown``), a dropped connection
  ``botocore.exceptions.ConnectionClosedError``, a truncated body ``aiohttp.ClientPayloadError`` (neither an
  OSError);
- a PUT with ``If-None-Match: *`` whose response is lost is stored, and botocore's retry of it gets the 412.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
from _extras import missing
from _fault_proxy import Fault

try:
    import s3fs
    from botocore.config import Config
    from botocore.exceptions import ClientError, ConnectionClosedError
    from botocore.session import get_session
except ImportError as e:  # the test extra brings them: fail, skip only on the GPU image (tests/_extras.py)
    missing(f"s3fs and botocore ({e})")

DATA = os.urandom(300_000)


def _fs(endpoint, attempts: int | None = None):
    """A fresh s3fs filesystem; ``attempts`` caps botocore's attempts and s3fs's own retries (1: no retry)."""
    options = dict(endpoint.storage_options, skip_instance_cache=True)
    if attempts is not None:
        options["config_kwargs"] = {"retries": {"total_max_attempts": attempts}}
    fs = s3fs.S3FileSystem(**options)
    if attempts is not None:
        fs.retries = attempts
    return fs


def _client(endpoint):
    return get_session().create_client(
        "s3",
        endpoint_url=endpoint.endpoint_url,
        aws_access_key_id=endpoint.key,
        aws_secret_access_key=endpoint.secret,
        region_name=endpoint.region,
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=30),
    )


def _path(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def test_put_get_and_ranged_get(s3_server):
    fs, url = _fs(s3_server), s3_server.url("roundtrip")
    assert url.startswith(f"s3://{s3_server.bucket}/roundtrip-") and url != s3_server.url("roundtrip")
    fs.pipe_file(url, DATA)
    assert fs.cat_file(url) == DATA
    assert fs.cat_file(url, start=1000, end=2000) == DATA[1000:2000]
    response = _client(s3_server).get_object(Bucket=s3_server.bucket, Key=_path(url)[1], Range="bytes=10-19")
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 206 and response["Body"].read() == DATA[10:20]


def test_requests_are_signed_with_the_test_identity(s3_server):
    url = s3_server.url("auth")
    _fs(s3_server).pipe_file(url, b"x")
    wrong = dict(s3_server.storage_options, secret="not-the-secret", skip_instance_cache=True)
    with pytest.raises(PermissionError):
        s3fs.S3FileSystem(**wrong).cat_file(url)


def test_conditional_puts_give_412(s3_server):
    client, (bucket, key) = _client(s3_server), _path(s3_server.url("cond"))
    etag = client.put_object(Bucket=bucket, Key=key, Body=b"first", IfNoneMatch="*")["ETag"]
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123456789abcdef0123456789abcdef"'}):
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=bucket, Key=key, Body=b"second", **condition)
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412, condition
        assert info.value.response["Error"]["Code"] == "PreconditionFailed"
    client.put_object(Bucket=bucket, Key=key, Body=b"third", IfMatch=etag)
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"third"
    # What s3fs makes of it: an OSError(EINVAL) caused by the ClientError, not FileExistsError (see the docstring).
    with pytest.raises(OSError) as raised:
        _fs(s3_server).pipe_file(f"s3://{bucket}/{key}", b"fourth", mode="create")
    assert type(raised.value) is OSError and raised.value.errno == errno.EINVAL
    assert isinstance(raised.value.__cause__, ClientError)
    assert raised.value.__cause__.response["Error"]["Code"] == "PreconditionFailed"


def test_env_alone_reaches_the_server_from_a_subprocess(fault_proxy):
    url = fault_proxy.url("env")
    _fs(fault_proxy).pipe_file(url, b"hello")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | fault_proxy.env
    code = f"import s3fs; print(s3fs.S3FileSystem().cat_file({url!r}).decode())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "hello", result.stderr[-2000:]
    assert fault_proxy.stats().requests.get("GET") == 1  # it went through the proxy: AWS_ENDPOINT_URL is honoured


def test_proxy_forwards_signed_requests_and_counts_bytes(fault_proxy):
    fs, url = _fs(fault_proxy), fault_proxy.url("count")
    fs.pipe_file(url, DATA)
    assert fault_proxy.stats().request_bytes == {"PUT": len(DATA)}
    assert fs.cat_file(url, start=0, end=4096) == DATA[:4096]
    assert fs.cat_file(url) == DATA
    stats = fault_proxy.stats()
    assert stats.response_bytes["GET"] == 4096 + len(DATA) and stats.requests["GET"] == 2
    assert stats.connections == 1  # keep-alive: every request of the test on one connection
    assert [r.range for r in fault_proxy.log() if r.method == "GET"] == ["bytes=0-4095", None]
    fault_proxy.reset_stats()
    assert fault_proxy.stats() == type(stats)({}, {}, {}, {}, 0) and fault_proxy.log() == []


@pytest.mark.parametrize("kind", ["status503", "status500", "drop", "truncate"])
def test_one_fault_is_retried_and_the_read_succeeds(fault_proxy, kind):
    fs, url = _fs(fault_proxy), fault_proxy.url(kind)
    fs.pipe_file(url, DATA)
    fault_proxy.reset_stats()
    fault_proxy.set_faults(Fault(kind, methods={"GET"}, truncate_at=1000))
    assert fs.cat_file(url) == DATA
    stats = fault_proxy.stats()
    assert stats.faults == {kind: 1} and stats.requests["GET"] == 2, stats


@pytest.mark.parametrize(
    "kind, error",
    [("status503", OSError), ("status500", OSError), ("drop", ConnectionClosedError), ("truncate", None)],
)
def test_a_lasting_fault_surfaces(fault_proxy, kind, error):
    import aiohttp

    url = fault_proxy.url(kind)
    _fs(fault_proxy).pipe_file(url, DATA)
    fault_proxy.set_faults(Fault(kind, count=None, methods={"GET"}, truncate_at=1000))
    with pytest.raises(error or aiohttp.ClientPayloadError) as raised:
        _fs(fault_proxy, attempts=1).cat_file(url)
    if kind == "status503":
        assert raised.value.errno == errno.EBUSY and raised.value.__cause__.response["Error"]["Code"] == "SlowDown"
    assert fault_proxy.stats().faults[kind] >= 1


def test_filters_and_seeded_probability(fault_proxy):
    fs, url = _fs(fault_proxy, attempts=1), fault_proxy.url("filter")
    fs.pipe_file(url, DATA)
    fault_proxy.set_faults(Fault("status503", count=None, ranged=True))
    assert fs.cat_file(url) == DATA  # not ranged: untouched
    with pytest.raises(OSError):
        fs.cat_file(url, start=0, end=10)
    draws = [Fault("drop", count=None, probability=0.5, seed=7) for _ in range(2)]
    assert [draws[0].fires("GET", False) for _ in range(32)] == [draws[1].fires("GET", False) for _ in range(32)]
    capped = Fault("drop", count=2, methods={"PUT"})
    assert [capped.fires(m, False) for m in ("GET", "PUT", "PUT", "PUT")] == [False, True, True, False]


def test_a_lost_response_to_a_create_put_comes_back_as_412(fault_proxy):
    """The ambiguous outcome a conditional commit must handle: stored, yet the client's retry is refused."""
    url = fault_proxy.url("lost")
    fault_proxy.set_faults(Fault("drop_response", methods={"PUT"}))
    with pytest.raises(OSError) as raised:
        _fs(fault_proxy).pipe_file(url, b"payload", mode="create")
    cause = raised.value.__cause__
    assert isinstance(cause, ClientError) and cause.response["Error"]["Code"] == "PreconditionFailed"
    assert [r.status for r in fault_proxy.log()] == [None, 412]
    assert _fs(fault_proxy).cat_file(url) == b"payload"


def test_the_server_dies_with_the_process_that_started_it(tmp_path):
    """A pytest killed mid-run (a CI timeout, Ctrl-C twice) must not leave ``weed`` running: the kernel kills it."""
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import _s3\n"
        "server = _s3.start_server(_s3.Path(sys.argv[2]))\n"
        "print(server.process.pid, flush=True); time.sleep(600)\n"
    )
    starter = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__), str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        pid = int(starter.stdout.readline())
        os.kill(pid, 0)  # running
    finally:
        starter.kill()
        starter.wait(timeout=60)
    deadline = time.monotonic() + 120  # the kernel kills it at once; the bound is for a loaded machine
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = _alive(pid)
    if outlived:
        os.kill(pid, signal.SIGKILL)
    assert not outlived, f"weed (pid {pid}) outlived the process that started it"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie of an exited child of someone else's does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
