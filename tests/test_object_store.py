"""Checkpoints in an object store: every route of the README against a real S3 server on loopback (SeaweedFS,
tests/_s3.py), with real process groups, real fairscale FSDP and real training steps.

Each route is checked against the same state through a local directory: a whole checkpoint saved to S3 and to
disk by the same job loads (at another world size and nesting) into the same parameters, buffers, optimizer
state and extra; the offline tools give the same bytes from either. The ranks of a load at the saved world size
fetch their own rank files only (counted at a proxy in front of the server).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.disk.byte_io import listed_etag
from fsdp_optim.disk.errors import ConcurrentCommitError
from fsdp_optim.disk.storage import ObjectStore

STEPS = 2


def _trained(rank: int, world_size: int, nesting: str = "deep", seed: int = 0) -> tuple[Any, Any]:
    root = M.wrap(M.make_net(seed), nesting)
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(STEPS):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    return root, optim


def _save_both(rank: int, world_size: int, store: ObjectStore, local: str, asynchronous: bool) -> None:
    root, optim = _trained(rank, world_size)
    extra = {"step": STEPS, "rank": rank, "rng": torch.Generator().manual_seed(rank).get_state()}
    if asynchronous:
        fsdp_optim.async_save_checkpoint(root, optim, store, extra=extra).wait()
    else:
        fsdp_optim.save_checkpoint(root, optim, store, extra=extra)
    fsdp_optim.save_checkpoint(root, optim, local, extra=extra)


def _load(rank: int, world_size: int, path: Any) -> dict[str, Any]:
    root = M.wrap(M.make_net(seed=99), "shallow")  # another init and nesting: the load must win
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    extra = fsdp_optim.load_checkpoint(root, optim, path)
    return {"extra": extra, "params": [p.detach().clone() for p in root.parameters()], "optim": optim.state_dict()}


@pytest.mark.parametrize("asynchronous", [False, pytest.param(True, marks=pytest.mark.slow)])  # async: the campaign
def test_whole_checkpoint_in_s3_loads_at_another_world_size_like_the_local_one(
    s3_server: Any, fault_proxy: Any, tmp_path: Path, asynchronous: bool
) -> None:
    url = s3_server.url("whole")
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    run_ranks(_save_both, 2, store, str(tmp_path / "local"), asynchronous)
    assert not Path("s3:").exists(), "a URL must never become a local directory"
    fault_proxy.reset_stats()
    from_store = run_ranks(_load, 3, fsdp_optim.open_store(url, **fault_proxy.storage_options))
    connections = fault_proxy.stats().connections
    from_disk = run_ranks(_load, 3, str(tmp_path / "local"))
    for rank, (a, b) in enumerate(zip(from_store, from_disk)):
        assert_identical(a, b, f"rank {rank}")
        assert a["extra"]["rank"] == rank % 2
    # The re-cut's byte ranges are fetched ahead, several at a time (ShardedCheckpoint.fetched_ahead): one
    # connection per rank would mean one range after another.
    assert connections > 3 + 1, f"{connections} connections for 3 ranks: the ranges were fetched one at a time"
    assert fsdp_optim.verify(store).ok


def _save_optim(rank: int, world_size: int, store: ObjectStore) -> dict[str, Any] | None:
    root, optim = _trained(rank, world_size)
    fsdp_optim.save_sharded_optim_state(root, optim, store)
    full = root.gather_full_optim_state_dict(optim)
    return full if rank == 0 else None


def _load_optim(rank: int, world_size: int, store: ObjectStore) -> dict[str, Any] | None:
    root = M.wrap(M.make_net(0), "shallow")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    fsdp_optim.load_sharded_optim_state(root, optim, store)
    full = root.gather_full_optim_state_dict(optim)
    return full if rank == 0 else None


def test_optimizer_checkpoint_in_s3_resharded_on_load(s3_server: Any, fault_proxy: Any) -> None:
    url = s3_server.url("optim")
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    saved = run_ranks(_save_optim, 2, store)[0]
    fault_proxy.reset_stats()
    loaded = run_ranks(_load_optim, 3, fsdp_optim.open_store(url, **fault_proxy.storage_options))[0]
    assert fault_proxy.stats().connections > 3 + 1, "the re-cut's ranges are fetched ahead, several at a time"
    assert_identical(saved["state"], loaded["state"])
    assert_identical(saved, fsdp_optim.consolidate(store))


def _load_own(rank: int, world_size: int, store: ObjectStore) -> None:
    root = M.wrap(M.make_net(seed=5), "deep")  # the saved layout: each rank reads its own files only
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    fsdp_optim.load_checkpoint(root, optim, store)


def test_a_load_at_the_saved_world_size_fetches_only_each_ranks_own_files(s3_server: Any, fault_proxy: Any) -> None:
    url = s3_server.url("own")
    direct = fsdp_optim.open_store(url, **s3_server.storage_options)
    run_ranks(_save_only, 2, direct)
    fault_proxy.reset_stats()
    run_ranks(_load_own, 2, fsdp_optim.open_store(url, **fault_proxy.storage_options))
    fetched = [r for r in fault_proxy.log() if r.method == "GET" and "optim-" in r.path]
    assert fetched, "the load read its rank files through the proxy"
    sizes = {o.name: o.size for o in direct.listing().values()}
    for rank_file, size in sizes.items():
        if rank_file.startswith("optim-"):
            got = sum(r.response_bytes for r in fetched if r.path.endswith(rank_file))
            assert got <= size, f"{rank_file}: fetched {got} bytes of a {size}-byte file (each rank reads its own once)"


def _save_only(rank: int, world_size: int, store: ObjectStore) -> None:
    root, optim = _trained(rank, world_size)
    fsdp_optim.save_checkpoint(root, optim, store, extra={"rank": rank})


def _managed(rank: int, world_size: int, store: ObjectStore, asynchronous: bool, steps: int) -> tuple[int, Any]:
    root = M.wrap(M.make_net(0), "deep" if world_size == 2 else "shallow")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    manager = fsdp_optim.CheckpointManager(store, every=2, keep=2, async_save=asynchronous)
    start = (manager.restore(root, optim) or {"step": 0})["step"]
    for step in range(start + 1, start + steps + 1):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        manager.save(step, root, optim, extra={"step": step})
    manager.wait()
    return start, manager.latest()


def test_checkpoint_manager_on_s3_prunes_and_resumes_at_another_world_size(s3_server: Any) -> None:
    url = s3_server.url("manager")
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    assert run_ranks(_managed, 2, store, False, 6) == [(0, 6), (0, 6)]
    assert run_ranks(_managed, 3, store, True, 4) == [(6, 10)] * 3
    out = _cli(s3_server, "list", url)
    assert [line.split()[1] for line in out.splitlines()] == ["8", "10"], out


def _cli(s3_server: Any, *args: str, ok: bool = True) -> str:
    import os

    env = {**os.environ, **s3_server.env}
    done = subprocess.run([sys.executable, "-m", "fsdp_optim", *args], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert (done.returncode == 0) == ok, f"fsdp-optim {' '.join(args)}: {done.returncode}\n{done.stdout}{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout + done.stderr


def test_offline_tools_read_one_store_and_write_another_place(s3_server: Any, tmp_path: Path) -> None:
    url = s3_server.url("offline")
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    run_ranks(_save_both, 2, store, str(tmp_path / "local"), False)
    local = tmp_path / "local"
    assert "verified: 5 files" in _cli(s3_server, "verify", url)
    assert "extra of ranks 0..1" in _cli(s3_server, "inspect", url)
    assert "verdict: equal (bitwise)" in _cli(s3_server, "diff", url, str(local))
    # reshard store -> store, then consolidate store -> store and store -> disk: the same bytes as from disk
    _cli(s3_server, "reshard", url, "--world-size", "3", "-o", f"{url}-w3")
    _cli(s3_server, "reshard", str(local), "--world-size", "3", "-o", str(tmp_path / "w3"))
    _cli(s3_server, "consolidate", f"{url}-w3", "-o", f"{url}-full/full.pt")
    _cli(s3_server, "consolidate", str(tmp_path / "w3"), "-o", str(tmp_path / "full.pt"))
    fs = store.fs
    remote_bytes = fs.cat_file(f"{store.root}-full/full.pt")
    refused = _cli(s3_server, "consolidate", f"{url}-w3", "-o", f"{url}-full/full.pt", "--rank", "1", ok=False)
    assert "an object is there already; pass --overwrite" in refused and fs.cat_file(f"{store.root}-full/full.pt") == (
        remote_bytes
    ), refused
    assert torch.load(tmp_path / "full.pt", weights_only=True).keys() == {"model", "optimizer", "extra"}
    (tmp_path / "remote.pt").write_bytes(remote_bytes)
    assert_identical(torch.load(tmp_path / "remote.pt", weights_only=True), torch.load(tmp_path / "full.pt",
                                                                                        weights_only=True))
    # the file consolidate wrote to the store, read back from there (fetched whole: one object, no checkpoint)
    assert "consolidated whole checkpoint file" in _cli(s3_server, "inspect", f"{url}-full/full.pt")
    assert "state: all finite" in _cli(s3_server, "verify", "--deep", f"{url}-full/full.pt")
    text = _cli(s3_server, "diff", url, f"{url}-full/full.pt", ok=False)  # the file keeps rank 0's extra only
    assert "every part compared is equal (bitwise)" in text and "extra of rank 1 | - | not compared" in text, text
    # convert from the store to local safetensors and DCP
    _cli(s3_server, "convert", url, "-o", str(tmp_path / "hf"), "--to", "safetensors")
    _cli(s3_server, "convert", url, "-o", str(tmp_path / "dcp"), "--to", "dcp")
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "dcp" / ".metadata").is_file()
    # the API reads a store and writes a local directory, and the other way
    fsdp_optim.reshard(store, 1, tmp_path / "w1")
    target = fsdp_optim.open_store(f"{url}-w2", **s3_server.storage_options)
    manifest = fsdp_optim.reshard(str(tmp_path / "w1"), 2, target)
    assert str(manifest) == f"{url}-w2/manifest.json"
    assert fsdp_optim.verify(target).ok


def test_refusals_say_what_and_write_nothing(s3_server: Any, tmp_path: Path) -> None:
    url = s3_server.url("refuse")
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    assert "no such object, and no manifest.json under it" in _cli(s3_server, "inspect", url, ok=False)
    assert "no filesystem for the scheme" in _cli(s3_server, "verify", "nosuchscheme://x/y", ok=False)
    run_ranks(_save_only, 2, fsdp_optim.open_store(f"{url}-ok", **s3_server.storage_options))
    assert "is also an input" in _cli(s3_server, "reshard", f"{url}-ok", "--world-size", "1", "-o", f"{url}-ok",
                                      ok=False)  # fmt: skip
    _cli(s3_server, "reshard", f"{url}-ok", "--world-size", "1", "-o", f"{url}-w1")
    assert "pass --overwrite" in _cli(s3_server, "reshard", f"{url}-ok", "--world-size", "3", "-o", f"{url}-w1",
                                      ok=False)  # fmt: skip
    store.fs.pipe_file(store.key("notes.txt"), b"mine")
    with pytest.raises(Exception, match="not an fsdp_optim checkpoint's"):
        run_ranks(_save_only, 2, store)
    assert sorted(store.listing()) == ["notes.txt"], "a refused save writes nothing"


def test_a_commit_over_a_changed_manifest_is_refused(s3_server: Any) -> None:
    """The conditional put itself: a manifest created by someone else since the save began wins (412)."""
    store = fsdp_optim.open_store(s3_server.url("cas"), **s3_server.storage_options)
    store.commit("manifest.json", b"{}", replaces=None)
    with pytest.raises(ConcurrentCommitError, match="another writer committed"):
        store.commit("manifest.json", b"{ }", replaces=None)
    etag = store.etag("manifest.json")
    listed = listed_etag(store.listing()["manifest.json"])
    assert listed == etag, f"a save's begin listing gives the version a HEAD gives: {listed} vs {etag}"
    store.commit("manifest.json", b"{  }", replaces=etag)
    with pytest.raises(ConcurrentCommitError):
        store.commit("manifest.json", b"{   }", replaces=etag)
    assert store.read_range("manifest.json", 0, 4) == b"{  }"


def test_ranged_reads_fill_parts_across_piece_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces fetched concurrently land in the parts they cover, whatever the boundaries (a memory:// store)."""
    import fsdp_optim.disk.storage as storage

    monkeypatch.setattr(storage, "PIECE_BYTES", 7)
    store = fsdp_optim.open_store("memory://ranged-reads")
    data = bytes(range(256)) * 3
    store.write("obj", data)
    for start, sizes in [(0, [768]), (5, [1, 30, 0, 2, 100]), (700, [13, 55])]:
        parts = [bytearray(n) for n in sizes]
        store.read_into("obj", start, [memoryview(p) for p in parts])
        assert b"".join(parts) == data[start : start + sum(sizes)]
    assert store.read_range("obj", 3, 700) == data[3:700]
    with pytest.raises(FileNotFoundError, match="no such object"):
        store.read_range("missing", 0, 100)
