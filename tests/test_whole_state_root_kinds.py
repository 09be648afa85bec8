"""Whole checkpoints on every root and option the optimizer functions accept: fairscale's own class (under
host execution) wrapped by ``auto_wrap``, mixed precision (the fp32 master shard is what is saved),
``move_params_to_cpu``, and MoE per-rank units (same world size; another one refused by name)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical, snapshot
from _dist import run_ranks
from test_root_kinds import _build, _switch
from test_whole_state import make_net

import fsdp_optim

OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "fairscale_auto_wrap": ("auto_wrap", {}),
    "mixed_precision": ("ours", {"mixed_precision": True}),
    # Offload computes on the GPU of a GPU machine (as in fairscale): the CPU path is named (tests/test_cuda_offload.py).
    "move_params_to_cpu": ("ours", {"move_params_to_cpu": True, "compute_device": torch.device("cpu")}),
}


def _root(kind: str, options: dict[str, Any], seed: int) -> torch.nn.Module:
    return _build(kind, make_net(seed)) if kind != "ours" else M.wrap(make_net(seed), "deep", **options)


def _roundtrip(rank: int, world_size: int, out: str, option: str) -> None:
    kind, options = OPTIONS[option]
    with _switch(kind):
        root = _root(kind, options, 0)
        optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
        for step in range(2):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        before = {"model": root.state_dict(), "optim": snapshot(optim.state_dict())}
        fsdp_optim.save_checkpoint(root, optim, out, extra={"step": 2})
        fresh = _root(kind, options, 123)
        fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
        assert fsdp_optim.load_checkpoint(fresh, fresh_optim, out) == {"step": 2}
        assert_identical(fresh.state_dict(), before["model"], f"{option} rank {rank}: model")
        assert_identical(fresh_optim.state_dict(), before["optim"], f"{option} rank {rank}: optimizer")
        M.train_step(fresh, fresh_optim, *M.local_batch(2, rank, world_size))  # and it trains on
        M.train_step(root, optim, *M.local_batch(2, rank, world_size))
        assert_identical(fresh.state_dict(), root.state_dict(), f"{option} rank {rank}: one step later")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_whole_checkpoint_round_trip(option: str, tmp_path) -> None:
    run_ranks(_roundtrip, 2, str(tmp_path / "ckpt"), option)


def _moe(rank: int, world_size: int, out: str, phase: str) -> str | None:
    from test_moe import _build as build_moe
    from test_moe import _train

    root, optim = build_moe(rank, world_size)
    if phase == "save":
        _train(root, optim, rank)
        fsdp_optim.save_checkpoint(root, optim, out)
        fresh, fresh_optim = build_moe(rank, world_size)
        fsdp_optim.load_checkpoint(fresh, fresh_optim, out)
        assert_identical(fresh.state_dict(), root.state_dict(), f"rank {rank}: MoE model")
        assert_identical(fresh_optim.state_dict(), optim.state_dict(), f"rank {rank}: MoE optimizer")
        return None
    with contextlib.suppress(ValueError):
        fsdp_optim.load_checkpoint(root, optim, out)
        return None
    try:
        fsdp_optim.load_checkpoint(root, optim, out)
    except ValueError as exc:
        return str(exc)
    return None


def test_moe_experts_round_trip_and_refuse_another_world_size(tmp_path) -> None:
    ckpt = str(tmp_path / "moe")
    run_ranks(_moe, 2, ckpt, "save")
    errors = run_ranks(_moe, 4, ckpt, "other")
    assert all(e is not None and "per-rank" in e and "world size 2" in e for e in errors), errors
    assert len(set(errors)) == 1, "every rank raises the same error"
    assert os.path.exists(os.path.join(ckpt, "manifest.json"))


def _async(rank: int, world_size: int, out: str) -> None:
    root = M.wrap(make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    at_save = {"model": root.state_dict(), "optim": snapshot(optim.state_dict())}
    handle = fsdp_optim.async_save_checkpoint(root, optim, out, extra={"step": 1})
    M.train_step(root, optim, *M.local_batch(1, rank, world_size))  # step() waits for the copy, then changes all
    handle.wait()
    fresh = M.wrap(make_net(seed=5), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    assert fsdp_optim.load_checkpoint(fresh, fresh_optim, out) == {"step": 1}
    assert_identical(fresh.state_dict(), at_save["model"], f"rank {rank}: model as at the call")
    assert_identical(fresh_optim.state_dict(), at_save["optim"], f"rank {rank}: optimizer as at the call")


def test_async_whole_checkpoint_is_the_state_at_the_call(tmp_path) -> None:
    run_ranks(_async, 2, str(tmp_path / "async"))


def _async_manager(rank: int, world_size: int, root: str) -> int | None:
    model = M.wrap(make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    manager = fsdp_optim.CheckpointManager(root, every=1, keep=2, async_save=True)
    for step in range(1, 5):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
        manager.save(step, model, optim, extra={"step": step})
    at_last = {"model": model.state_dict(), "optim": snapshot(optim.state_dict())}
    manager.wait()
    fresh = M.wrap(make_net(seed=9), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    assert manager.restore(fresh, fresh_optim) == {"step": 4}
    assert_identical(fresh.state_dict(), at_last["model"], f"rank {rank}: restored model")
    assert_identical(fresh_optim.state_dict(), at_last["optim"], f"rank {rank}: restored optimizer")
    return manager.latest()


def test_manager_with_async_saves_keeps_the_newest_and_restores_them(tmp_path) -> None:
    assert run_ranks(_async_manager, 2, str(tmp_path)) == [4, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
