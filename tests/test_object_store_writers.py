"""Writers that die or race, and objects damaged in the store (the store's fault campaign, continued).

- A writer job (a subprocess, tests/_store_writer.py) SIGKILLed mid-save: the previous checkpoint still loads; the
  next save to the prefix succeeds and removes the killed writer's files, and only those (a foreign object survives
  a save with ``overwrite=True``; without it the prefix is refused).
- Two writer jobs committing to one prefix at the same moment: exactly one wins, the other gets
  ``ConcurrentCommitError``; the committed checkpoint verifies and holds the winner's state alone; nothing of the
  loser is left.
- An object overwritten with flipped bytes: verify and consolidate refuse it with a checksum error naming it; a
  truncated ranged GET is retried and never yields wrong data.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _store_campaign as C
import pytest
import torch
from _checks import assert_identical
from _extras import missing

try:
    import s3fs
except ImportError as e:  # the test extra brings it: fail, skip only on the GPU image (tests/_extras.py)
    missing(f"s3fs ({e})")
from _fault_proxy import Fault
from test_object_store_faults import environment

import fsdp_optim
from fsdp_optim.disk.byte_io import read_all
from fsdp_optim.disk.errors import ConcurrentCommitError
from fsdp_optim.formats.sharded.locate import read_manifest

WRITER = Path(__file__).with_name("_store_writer.py")
DEADLINE_S = 180


def writer(url: str, name: str, steps: int, env: dict[str, str], *options: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WRITER), url, name, str(steps), *options],
        env=C.env_with(env) | {"PYTHONPATH": os.pathsep.join([str(WRITER.parent.parent), str(WRITER.parent)])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(process: subprocess.Popen) -> dict[str, Any]:
    out, err = process.communicate(timeout=DEADLINE_S)
    assert process.returncode == 0 and out.strip(), f"writer exited {process.returncode}:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def check_holds(url: str, state_file: Path, name: str) -> None:
    """``url`` verifies and consolidates to writer ``name``'s state, whole."""
    assert fsdp_optim.verify(url).ok
    full = fsdp_optim.consolidate(url)
    assert full["extra"] == {"writer": name}
    assert_identical(C.content(full["optimizer"]), torch.load(state_file, weights_only=True), name)


def only_checkpoint(url: str, *foreign: str) -> None:
    """Nothing under ``url`` but its manifest, the files it lists and ``foreign``."""
    store = fsdp_optim.open_store(url)
    expected = set(read_manifest(url).file_names()) | {"manifest.json", *foreign}
    assert set(store.listing()) == expected, sorted(set(store.listing()) ^ expected)


def test_a_writer_killed_mid_save(fault_proxy, tmp_path):
    url, env = fault_proxy.url("killed"), fault_proxy.env
    assert result(writer(url, "first", 2, env, "--state", str(tmp_path / "first.pt"))) == {"ok": True}
    with environment(env):
        fsdp_optim.open_store(url).write("notes.txt", b"not a checkpoint's")
    fault_proxy.reset_stats()
    # The killed writer's first upload gets through; every later put fails (and is retried) until it is killed.
    fault_proxy.set_faults(Fault("status503", count=None, methods={"PUT"}, after=1))
    killed = writer(url, "killed", 3, {**env, "TMPDIR": str(tmp_path)}, "--overwrite")  # its staging: ours to remove
    deadline = time.monotonic() + DEADLINE_S
    while not any(r.method == "PUT" and r.fault for r in fault_proxy.log()):
        assert killed.poll() is None and time.monotonic() < deadline, "the writer ended before it was killed"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    fault_proxy.clear()
    puts = [r.path.rsplit("/", 1)[-1] for r in fault_proxy.log() if r.method == "PUT" and r.status == 200]
    uploaded = [n for n in puts if n != "notes.txt"]  # (the proxy may log that put after reset_stats)
    assert len(uploaded) == 1 and uploaded[0].startswith("optim-"), uploaded
    with environment(env):
        check_holds(url, tmp_path / "first.pt", "first")  # the previous checkpoint still loads
        assert uploaded[0] in fsdp_optim.open_store(url).listing()  # the killed writer's leftover
    time.sleep(1.1)  # the next save's files must be newer than the leftover (the store's times are in seconds)
    outcome = result(writer(url, "next", 4, env, "--refused-first", "--state", str(tmp_path / "next.pt")))
    assert outcome["ok"] and "notes.txt" in outcome["refused"], outcome
    with environment(env):
        check_holds(url, tmp_path / "next.pt", "next")
        only_checkpoint(url, "notes.txt")  # the leftover removed, the foreign object kept
        assert read_all(fsdp_optim.open_store(url), "notes.txt", limit=100) == b"not a checkpoint's"


def test_two_writers_of_one_prefix(fault_proxy, tmp_path):
    url, env = fault_proxy.url("race"), fault_proxy.env
    assert result(writer(url, "before", 1, env)) == {"ok": True}
    writers = {
        name: writer(url, name, steps, env, "--hold", str(tmp_path), "--state", str(tmp_path / f"{name}.pt"))
        for name, steps in (("a", 2), ("b", 3))
    }
    deadline = time.monotonic() + DEADLINE_S
    while not all((tmp_path / f"ready-{name}").exists() for name in writers):  # both began and uploaded
        assert all(w.poll() is None for w in writers.values()) and time.monotonic() < deadline
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outcomes = {name: result(w) for name, w in writers.items()}
    winners = [name for name, o in outcomes.items() if o["ok"]]
    assert len(winners) == 1, outcomes
    loser = next(o for o in outcomes.values() if not o["ok"])
    assert loser["type"] == ConcurrentCommitError.__name__ and url in loser["error"], loser
    with environment(env):
        check_holds(url, tmp_path / f"{winners[0]}.pt", winners[0])
        only_checkpoint(url)  # the loser removed its files; the winner those of the checkpoint it replaced


@pytest.fixture
def copy_of_checkpoint(s3_server) -> str:
    """A fresh checkpoint (a re-cut of one written by a writer job) to damage."""
    url = s3_server.url("damaged")
    assert result(writer(url + "-src", "src", 2, s3_server.env)) == {"ok": True}
    with environment(s3_server.env):
        fsdp_optim.reshard(url + "-src", 2, url)
    return url


def test_flipped_bytes_in_the_store_are_refused(s3_server, copy_of_checkpoint):
    url = copy_of_checkpoint
    with environment(s3_server.env):
        name = sorted(n for n in fsdp_optim.open_store(url).listing() if n.startswith("optim-"))[0]
        fs = s3fs.S3FileSystem(**s3_server.storage_options, skip_instance_cache=True)
        data = bytearray(fs.cat_file(f"{url}/{name}"))
        data[-100] ^= 0xFF  # in the last chunk of the last tensor: the header still parses
        fs.pipe_file(f"{url}/{name}", bytes(data))
        verification = fsdp_optim.verify(url)
        assert not verification.ok and name in str(verification), verification
        with pytest.raises(ValueError, match=f"{name}.*checksum|checksum.*{name}"):
            fsdp_optim.consolidate(url)


def test_a_truncated_ranged_get_is_retried_never_wrong(fault_proxy, s3_server, copy_of_checkpoint):
    url = copy_of_checkpoint
    with environment(s3_server.env):
        expected = fsdp_optim.consolidate(url)
    with environment(fault_proxy.env):
        proxied = url.replace(s3_server.bucket, fault_proxy.endpoint.bucket)
        store = fsdp_optim.open_store(proxied)
        name = sorted(n for n in store.listing() if n.startswith("optim-"))[0]
        size = store.size(name)
        assert size is not None
        whole = bytes(store.read_range(name, 0, size))
        for cut in (0, 1, 4095):
            fault_proxy.set_faults(Fault("truncate", count=2, ranged=True, truncate_at=cut))
            assert bytes(store.read_range(name, 0, size)) == whole, f"truncated at {cut}"
            fault_proxy.set_faults(Fault("truncate", count=2, ranged=True, truncate_at=cut))
            assert_identical(fsdp_optim.consolidate(proxied), expected, f"truncated at {cut}")
        fault_proxy.set_faults(Fault("truncate", count=None, ranged=True, truncate_at=10))
        with pytest.raises(OSError, match=name):
            store.read_range(name, 0, size)
        assert fault_proxy.stats().faults["truncate"] >= 3 * 4
