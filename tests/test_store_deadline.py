"""A store that keeps failing gives up within its deadline, on every rank, naming the object; refused credentials
are an answer (not retried) that every CLI verb reports with the URL and where credentials come from.

Against the real S3 server (tests/_s3.py) through the fault proxy (tests/_fault_proxy.py), with the client's own
retries left at their defaults, so that the deadline is what stops them. The deadline is short here (5 s); the
bounds the tests wait for are generous (no timing assertions).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import _models as M
import pytest
from _dist import run_ranks
from _fault_proxy import Fault

import fsdp_optim
from fsdp_optim.disk.storage import ObjectStore

DEADLINE_S = 5
BOUND_S = 180  # far above the deadline: a run that has not ended by then did not give up
RANK1 = "rank00001-of-00002"


def _trained(rank: int, world_size: int) -> tuple[Any, Any]:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    return root, optim


def _save(rank: int, world_size: int, store: ObjectStore) -> None:
    fsdp_optim.save_checkpoint(*_trained(rank, world_size), store, extra={"rank": rank})


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _load(rank: int, world_size: int, store: ObjectStore) -> tuple[str, str]:
    root = M.wrap(M.make_net(seed=5), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    return _outcome(lambda: fsdp_optim.load_checkpoint(root, optim, store))


def _save_outcome(rank: int, world_size: int, store: ObjectStore) -> tuple[str, str]:
    return _outcome(lambda: _save(rank, world_size, store))


@pytest.fixture(scope="module")
def saved(s3_server: Any) -> str:
    """A whole checkpoint saved at W=2 (fault-free, straight to the server)."""
    url = s3_server.url("deadline")
    run_ranks(_save, 2, fsdp_optim.open_store(url, **s3_server.storage_options))
    return url


def _through(fault_proxy: Any, url: str) -> ObjectStore:
    """``url`` (a prefix of the server's bucket) reached through the proxy, with the short deadline."""
    return fsdp_optim.open_store(url, deadline_s=DEADLINE_S, **fault_proxy.storage_options)


def test_a_lasting_outage_of_one_rank_file_fails_the_load_on_every_rank(fault_proxy: Any, saved: str) -> None:
    fault_proxy.set_faults(Fault("status503", count=None, methods={"GET"}, path=RANK1))
    outcomes = run_ranks(_load, 2, _through(fault_proxy, saved), deadline_s=BOUND_S)
    assert fault_proxy.stats().faults["status503"] > 0, "the fault never fired"
    for rank, (kind, message) in enumerate(outcomes):
        assert kind != "ok", f"rank {rank}: a load whose rank file the store never served succeeded"
        assert f"{saved}/" in message and RANK1 in message, f"rank {rank}: {kind}: {message}"
    kind, message = outcomes[1]  # the rank whose file it is: stopped by the deadline, not by running out of tries
    assert kind == "StoreUnavailable" and "at the store deadline, 5 s" in message, (kind, message)


def test_transient_faults_within_the_deadline_still_recover(fault_proxy: Any, saved: str) -> None:
    fault_proxy.set_faults(Fault("status503", count=2, methods={"GET"}, path=RANK1))
    outcomes = run_ranks(_load, 2, _through(fault_proxy, saved), deadline_s=BOUND_S)
    assert fault_proxy.stats().faults["status503"] == 2
    assert outcomes == [("ok", ""), ("ok", "")], outcomes


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_a_save_to_a_wrong_endpoint_fails_on_every_rank(s3_server: Any) -> None:
    options = dict(s3_server.storage_options, client_kwargs={"endpoint_url": f"http://127.0.0.1:{_closed_port()}"})
    url = s3_server.url("nowhere")
    store = fsdp_optim.open_store(url, deadline_s=DEADLINE_S, **options)
    outcomes = run_ranks(_save_outcome, 2, store, deadline_s=BOUND_S)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind != "ok" and url in message, f"rank {rank}: {kind}: {message}"
    assert any(kind == "StoreUnavailable" for kind, _ in outcomes), outcomes


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # only what ``env`` says
    return subprocess.run([sys.executable, "-m", "fsdp_optim", *args], capture_output=True, text=True,
                          env={**base, **env}, timeout=BOUND_S)  # fmt: skip


def test_inspect_of_a_wrong_endpoint_gives_up_at_the_deadline_from_the_environment(s3_server: Any, saved: str) -> None:
    env = {**s3_server.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}"}
    done = _cli({**env, "FSDP_OPTIM_STORE_DEADLINE_S": str(DEADLINE_S)}, "inspect", saved)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{saved}/manifest.json" in done.stderr and "failed after" in done.stderr, done.stderr


def test_a_deadline_that_is_not_a_number_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_OPTIM_STORE_DEADLINE_S", "soon")
    with pytest.raises(ValueError, match="FSDP_OPTIM_STORE_DEADLINE_S: expected a number of seconds, found 'soon'"):
        fsdp_optim.open_store("memory://deadline/x")
    with pytest.raises(ValueError, match="deadline_s: expected a positive"):
        fsdp_optim.open_store("memory://deadline/x", deadline_s=0)


VERBS = {
    "inspect": ["inspect", "{url}"],
    "verify": ["verify", "{url}"],
    "list": ["list", "{url}"],
    "consolidate": ["consolidate", "{url}", "-o", "{tmp}/full.pt"],
    "reshard": ["reshard", "{url}", "--world-size", "1", "-o", "{tmp}/w1"],
}


@pytest.mark.parametrize("credentials", ["wrong", "missing"])
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_refused_credentials_name_the_url_and_are_not_retried(
    fault_proxy: Any, saved: str, tmp_path: Path, verb: str, credentials: str
) -> None:
    env = dict(fault_proxy.env, AWS_SECRET_ACCESS_KEY="not-the-secret")
    if credentials == "missing":
        env = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    args = [a.format(url=saved, tmp=tmp_path) for a in VERBS[verb]]
    fault_proxy.reset_stats()
    done = _cli(env, *args)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert saved in done.stderr and "refused access" in done.stderr and "AWS_ACCESS_KEY_ID" in done.stderr, done.stderr
    requests = sum(fault_proxy.stats().requests.values())
    assert requests <= 1, f"{verb}: {requests} requests: refused credentials were asked again"
    assert not list(tmp_path.iterdir()), f"{verb} wrote {list(tmp_path.iterdir())}"


def test_the_api_raises_permission_error_naming_the_object(s3_server: Any, saved: str) -> None:
    options = dict(s3_server.storage_options, secret="not-the-secret")
    with pytest.raises(PermissionError, match=f"{saved}/manifest.json: .*refused access"):
        fsdp_optim.verify(fsdp_optim.open_store(saved, **options))


def test_a_frozen_server_fails_a_request_at_the_deadline_and_says_a_transfers_allowance(fault_proxy: Any) -> None:
    """A server that takes requests and never answers (the proxy's ``stall``): a small request gives up at the
    deadline; a large upload is allowed its bytes at 4 MiB/s on top, and the message says so (before: "at the store
    deadline, 20 s" after 50 s, the 30 s allowance unsaid)."""
    store = fsdp_optim.open_store(fault_proxy.url("frozen"), deadline_s=2, **fault_proxy.storage_options)
    fault_proxy.set_faults(Fault("stall", count=None))
    kind, message = _outcome(lambda: store.size("manifest.json"))
    assert kind == "StoreUnavailable" and "at the store deadline, 2 s (" in message, (kind, message)
    assert "allowed for" not in message, message
    assert "failed after 1 attempt in" in message and "no answer before the attempt's time was up" in message, message
    kind, message = _outcome(lambda: store.write("big.bin", bytes(8 << 20)))
    assert kind == "StoreUnavailable" and "big.bin" in message, (kind, message)
    assert "at the store deadline, 2 s, plus 2.0 s allowed for its 8.0 MiB transfer at 4 MiB/s" in message, message
    assert fault_proxy.stats().faults["stall"] >= 2, fault_proxy.stats()


@pytest.mark.parametrize("where", ["missing_bucket", "empty_prefix"])
def test_list_of_a_prefix_with_nothing_below_it_exits_1(s3_server: Any, where: str) -> None:
    """Before: "no step directories" and exit 0, where a missing local root exits 1."""
    url = "s3://no-such-bucket-fsdp-optim/run" if where == "missing_bucket" else s3_server.url("nothing-here")
    done = _cli(s3_server.env, "list", url)
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, (done.stdout, done.stderr)
    assert f"{url}: nothing is stored under this prefix (no such bucket" in done.stderr, done.stderr
