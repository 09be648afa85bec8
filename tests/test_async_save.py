"""Asynchronous sharded save (issue "Speed", item 1): real gloo ranks, real fairscale FSDP, real Adam steps,
real files, a real ``RLIMIT_FSIZE`` write failure and a real ``SIGKILL``.

- The checkpoint holds the state at the time of the call although the optimizer steps during the upload.
- A second save while one is in flight waits for it; both commit, in call order.
- A write failure on one rank's background thread raises on every rank's ``wait()``, leaves the previous
  checkpoint loadable, and surfaces at the next save where nobody called ``wait()``.
- A process killed mid-upload leaves a loadable checkpoint: the previous one or the new one, never a mix.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical, snapshot
from _dist import run_ranks

from fsdp_optim import AsyncSave, consolidate, load_sharded_optim_state
from fsdp_optim.job.async_save import async_save_sharded_optim_state


def _setup(rank: int, world_size: int) -> tuple:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    return root, optim


def _ordering_job(rank: int, world_size: int, out: str) -> dict:
    root, optim = _setup(rank, world_size)
    at_call = snapshot(optim.state_dict())
    handle = async_save_sharded_optim_state(root, optim, os.path.join(out, "a"))
    for step in range(2, 4):  # the optimizer steps while the upload runs
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    manifest = handle.wait()
    assert handle.done() and os.path.basename(manifest) == "manifest.json"
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    load_sharded_optim_state(root, fresh, os.path.join(out, "a"))
    assert_identical(fresh.state_dict()["state"], at_call["state"], f"rank {rank}: state at the call")

    # Two saves into one directory, the second started while the first is in flight.
    first_state = snapshot(optim.state_dict())
    first = async_save_sharded_optim_state(root, optim, os.path.join(out, "b"))
    M.train_step(root, optim, *M.local_batch(4, rank, world_size))
    second_state = snapshot(optim.state_dict())
    second = async_save_sharded_optim_state(root, optim, os.path.join(out, "b"))  # waits for the first
    assert first.done(), "a second save must wait for the one in flight"
    first.wait()
    second.wait()
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    load_sharded_optim_state(root, fresh, os.path.join(out, "b"))
    assert_identical(fresh.state_dict()["state"], second_state["state"], f"rank {rank}: the later save wins")
    assert not torch.equal(  # the two saves really held different states
        next(iter(first_state["state"].values()))["exp_avg"], next(iter(second_state["state"].values()))["exp_avg"]
    )
    return {"ok": True}


def test_async_save_holds_the_state_at_the_call_and_saves_in_order(tmp_path) -> None:
    assert all(r["ok"] for r in run_ranks(_ordering_job, 2, str(tmp_path)))


def _failure_job(rank: int, world_size: int, out: str) -> dict:
    root, optim = _setup(rank, world_size)
    directory = os.path.join(out, "ckpt")
    async_save_sharded_optim_state(root, optim, directory).wait()  # the previous checkpoint
    saved = snapshot(optim.state_dict())
    M.train_step(root, optim, *M.local_batch(2, rank, world_size))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write then fails with EFBIG
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, limits[1]))  # below its rank file (~1.4 KB)
    errors = {}
    try:
        try:
            async_save_sharded_optim_state(root, optim, directory).wait()
        except Exception as exc:  # noqa: BLE001 - every rank must get here
            errors["wait"] = f"{type(exc).__name__}: {exc}"
        # A failed save nobody waited for surfaces at the next save.
        async_save_sharded_optim_state(root, optim, directory)  # fails in the background again (rank 1)
        time.sleep(0.5)
        try:
            async_save_sharded_optim_state(root, optim, directory)
        except RuntimeError as exc:
            errors["next"] = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    load_sharded_optim_state(root, fresh, directory)
    assert_identical(fresh.state_dict()["state"], saved["state"], f"rank {rank}: the previous checkpoint")
    return errors


def test_a_background_failure_raises_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path) -> None:
    results = run_ranks(_failure_job, 2, str(tmp_path))
    for rank, errors in enumerate(results):
        assert "wait" in errors, f"rank {rank}: wait() did not raise"
        assert "previous async save" in errors.get("next", ""), (rank, errors)
    assert "rank 1" in results[0]["wait"], results[0]  # rank 0 learns which rank failed


def _killed_job(rank: int, world_size: int, out: str, delay: float) -> None:
    root, optim = _setup(rank, world_size)
    directory = os.path.join(out, "ckpt")
    async_save_sharded_optim_state(root, optim, directory).wait()
    torch.save(root.gather_full_optim_state_dict(optim), os.path.join(out, "a.pt"))
    M.train_step(root, optim, *M.local_batch(2, rank, world_size))
    torch.save(root.gather_full_optim_state_dict(optim), os.path.join(out, "b.pt"))
    async_save_sharded_optim_state(root, optim, directory)
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.2])
def test_a_kill_mid_upload_leaves_a_loadable_checkpoint(tmp_path, delay: float) -> None:
    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_killed_job, 1, str(tmp_path), delay)
    full = consolidate(tmp_path / "ckpt")  # every checksum verified
    candidates = [torch.load(tmp_path / name, weights_only=True) for name in ("a.pt", "b.pt")]
    matches = []
    for candidate in candidates:
        try:
            assert_identical(full["state"], candidate["state"])
            matches.append(True)
        except AssertionError:
            matches.append(False)
    assert any(matches), "the checkpoint left behind is neither the previous save nor the new one"


def _deferred_copy_job(rank: int, world_size: int, out: str) -> dict:
    """The copy into host memory runs after the call returns; the next step (or load_state_dict) waits for it."""
    from fsdp_optim.job.staging import HostStaging

    root, optim = _setup(rank, world_size)
    real = HostStaging.copy

    def slow_copy(self: Any, *args: Any) -> Any:  # a copy that takes long enough to be overtaken if unguarded
        time.sleep(0.5)
        return real(self, *args)

    HostStaging.copy = slow_copy  # type: ignore[method-assign]
    try:
        results = {}
        for how in ("step", "load_state_dict"):
            at_call = snapshot(optim.state_dict())
            handle = async_save_sharded_optim_state(root, optim, os.path.join(out, how))
            results[f"{how}: returned before the copy"] = not handle.staged.is_set()
            if how == "step":
                M.train_step(root, optim, *M.local_batch(9, rank, world_size))  # steps at once: must wait
            else:
                optim.load_state_dict(M.OPTIMIZERS["adam"](M.fsdp_param_groups(root)).state_dict())
            results[f"{how}: waited for the copy"] = handle.staged.is_set()
            handle.wait()
            fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
            load_sharded_optim_state(root, fresh, os.path.join(out, how))
            assert_identical(fresh.state_dict()["state"], at_call["state"], f"rank {rank}, {how}: state at the call")
            M.train_step(root, optim, *M.local_batch(10, rank, world_size))
    finally:
        HostStaging.copy = real  # type: ignore[method-assign]
    return results


def test_the_copy_runs_after_the_call_and_the_next_step_waits_for_it(tmp_path) -> None:
    for results in run_ranks(_deferred_copy_job, 2, str(tmp_path)):
        assert all(results.values()), results



def _many_roots_job(rank: int, world_size: int, out: str) -> dict:
    import gc

    from fsdp_optim.job import async_save as A

    root, optim = _setup(rank, world_size)
    saves = []
    for s in range(3):  # many saves of one root: one handle and one set of buffers, reused
        async_save_sharded_optim_state(root, optim, os.path.join(out, "kept")).wait()
        M.train_step(root, optim, *M.local_batch(s, rank, world_size))
        saves.append((len(A._inflight), len(A._staging), A._staging[root].buffers))
    dropped = []
    for r in range(3):  # roots saved once and dropped (untrained: fairscale's backward hooks keep a trained one)
        other = M.wrap(M.make_net(), "deep")
        async_save_sharded_optim_state(other, M.OPTIMIZERS["adam"](M.fsdp_param_groups(other)), f"{out}/d{r}").wait()
        del other
        gc.collect()
        dropped.append((len(A._inflight), len(A._staging)))
    return {"saves": saves, "dropped": dropped}


def test_a_long_job_of_many_roots_and_saves_keeps_nothing_it_no_longer_needs(tmp_path) -> None:
    for rank, held in enumerate(run_ranks(_many_roots_job, 2, str(tmp_path))):
        saves, dropped = held["saves"], held["dropped"]
        assert len(set(saves)) == 1 and saves[0][:2] == (1, 1) and saves[0][2] > 0, (
            f"rank {rank}: (handles, staging sets, buffers) after each save of one root: {saves}"
        )
        assert dropped == [(1, 1)] * 3, f"rank {rank}: (handles, staging sets) after each dropped root: {dropped}"


def test_async_save_has_a_useful_repr(tmp_path) -> None:
    handle = AsyncSave(tmp_path / "ckpt")
    text = repr(handle)
    assert "AsyncSave" in text and str(tmp_path / "ckpt") in text and "running" in text
