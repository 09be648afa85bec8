"""The examples run as their docstrings say: ``examples/memory_tier_recovery.py`` at its default size (a node lost,
the job resumed one node smaller from the survivors' memory) and ``examples/s3_server.py`` (a real S3 server on
loopback that a client reaches with the printed ``export`` lines, stopped by Ctrl-C)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from _s3 import weed_binary

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 300


def test_memory_tier_recovery_default_size() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "memory_tier_recovery.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "W=1: restored step 7 from the memory tier" in lines and "W=1: trained to step 10" in lines, done.stdout
    assert any(line.startswith("phase 1 ended: process 1 terminated with signal SIGKILL") for line in lines), lines


def _lines(stream: object) -> tuple[queue.Queue[str], threading.Thread]:
    """Each line of ``stream`` as it comes; the reader ends at the end of the stream."""
    out: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:  # type: ignore[attr-defined]
            out.put(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return out, reader


def _listening(url: str) -> bool:
    parsed = urlparse(url)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((parsed.hostname, parsed.port)) == 0


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_s3_server_serves_until_interrupted(tmp_path: Path) -> None:
    weed_binary()  # skips where SeaweedFS has no binary for this platform
    # Started as `cmd &` in a script would start it: with SIGINT ignored (inherited). It must stop on SIGINT anyway;
    # it did not (Python keeps an inherited SIG_IGN), so the test waited for an exit that never came.
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "s3_server.py"), "--bucket", "tryout", "--dir", str(tmp_path / "s3")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_sigint_ignored,
    )  # fmt: skip
    try:
        lines, reader = _lines(server.stdout)
        shown: list[str] = []
        stop_at = time.monotonic() + DEADLINE_S
        while not shown or shown[-1] != "serving; Ctrl-C stops it":
            assert time.monotonic() < stop_at and server.poll() is None, shown
            try:
                shown.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        env = dict(line[len("export ") :].split("=", 1) for line in shown if line.startswith("export "))
        assert set(env) >= {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, shown
        assert urlparse(env["AWS_ENDPOINT_URL"]).hostname == "127.0.0.1", env
        client = (
            "import fsdp_optim; from fsdp_optim.disk.byte_io import read_all; s = fsdp_optim.open_store('s3://tryout/run'); "
            "s.write('a.txt', b'hello'); assert read_all(s, 'a.txt', limit=10) == b'hello'"
        )
        keep = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        used = subprocess.run([sys.executable, "-c", client], cwd=ROOT, env={**keep, **env}, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert used.returncode == 0, used.stderr[-4000:]
        server.send_signal(signal.SIGINT)
        # The exit is the signal waited for; the bound only keeps a broken example from hanging the suite (its stop
        # is bounded by tests/_s3.py: SIGTERM, then SIGKILL), so it is generous for a loaded machine.
        code = server.wait(timeout=DEADLINE_S)
        reader.join(timeout=DEADLINE_S)  # the rest of its output, to its end
        rest = [*shown]
        while not lines.empty():
            rest.append(lines.get())
        assert code == 0 and rest[-1] == "stopped", (code, rest)
        assert not _listening(env["AWS_ENDPOINT_URL"]), "the server still answers after Ctrl-C"
        assert (tmp_path / "s3").is_dir(), "--dir keeps the data"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("argv", [["--nodes", "1"], ["--ranks-per-node", "0"]])
def test_memory_tier_recovery_refuses_a_size_it_cannot_run(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "memory_tier_recovery.py"), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--nodes must be at least 2" in done.stderr, done.stderr
