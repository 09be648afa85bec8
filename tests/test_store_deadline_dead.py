"""A verb against a store endpoint that never answers (a socket that accepts and stays silent, with nothing behind
it): it gives up within the store deadline, 20% plus one attempt's least time (``MIN_ATTEMPT_S``), naming the
object, and says so on one line. Measured in this process, after the imports: a process's own start and exit
(Python, torch) come on top, whatever the deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from _extras import missing

from fsdp_optim.cli import main
from fsdp_optim.disk.store_policy import DEADLINE_ENV, MIN_ATTEMPT_S

try:
    import s3fs  # the store a URL without a registered backend reaches
except ImportError as e:
    missing(f"s3fs ({e})")

DEADLINE_S = 3.0


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    # s3fs keeps one filesystem per set of arguments for the process, and the endpoint comes from the environment:
    # an earlier test's filesystem (a live local server) would answer instead of the silent endpoint.
    s3fs.S3FileSystem.clear_instance_cache()
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # connections are accepted by the kernel and never answered
    try:
        yield f"http://127.0.0.1:{hole.getsockname()[1]}"
    finally:
        hole.close()
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("verb", ["inspect", "list"])
def test_a_verb_gives_up_within_the_store_deadline(
    silent_endpoint: str, verb: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(DEADLINE_ENV, str(DEADLINE_S))
    monkeypatch.setenv("AWS_ENDPOINT_URL", silent_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    import fsdp_optim.disk.storage  # noqa: F401 - the verb's imports (seconds on a loaded machine) are not measured
    import fsdp_optim.offline.sources  # noqa: F401

    began = time.monotonic()
    code = main([verb, "s3://bucket/run/step-00000001" if verb == "inspect" else "s3://bucket/run"])
    spent = time.monotonic() - began
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "store deadline" in err[0], err
    assert spent <= 1.2 * DEADLINE_S + MIN_ATTEMPT_S, f"{verb} took {spent:.1f} s for a {DEADLINE_S} s deadline"
