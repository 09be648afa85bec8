"""The whole training state (weights, buffers, optimizer, extra) in one sharded checkpoint: saved at W = 2,
resumed at the same and at other world sizes and nestings, bit-identical, and training continues to match
uninterrupted training without FSDP; a load that fails anywhere changes nothing anywhere."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_full_matches_plain, assert_identical
from _dist import run_ranks

import fsdp_optim

SAVE_AT, TOTAL = 3, 5
REL = 1e-4


def make_net(seed: int = 0) -> M.Net:
    """The test model plus a persistent buffer in a nested unit and a non-persistent one in the root."""
    net = M.make_net(seed)
    net.block1.register_buffer("seen", torch.arange(4.0) + seed)
    net.register_buffer("cache", torch.zeros(2), persistent=False)
    return net


def _extra(rank: int) -> dict[str, Any]:
    return {
        "step": SAVE_AT,
        "rank": rank,
        "rng": torch.Generator().manual_seed(7 + rank).get_state(),  # a per-rank RNG state
        "scheduler": {"last_epoch": SAVE_AT, "base_lrs": (0.01, 0.02), "inf": math.inf},
        "$odd key": [None, True, "x", (1, 2.5)],
    }


def _buffers(root: Any) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in root.named_buffers() if n.endswith("seen")}


def _save(rank: int, world_size: int, out: str, per_rank_buffer: bool) -> dict[str, Any] | None:
    root = M.wrap(make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(SAVE_AT):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    for _, buffer in root.named_buffers():
        if buffer.shape == (4,):
            buffer.add_(10.0 + (rank if per_rank_buffer else 0))
    fsdp_optim.save_checkpoint(root, optim, out, extra=_extra(rank))
    model_state = root.state_dict()
    full = root.gather_full_optim_state_dict(optim)
    return {"model": model_state, "optim": full} if rank == 0 else None


def _resume(rank: int, world_size: int, src: str, nesting: str, flatten: bool) -> dict[str, Any]:
    root = M.wrap(make_net(seed=123), nesting, flatten=flatten)  # other init: the load must win
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    extra = fsdp_optim.load_checkpoint(root, optim, src)
    loaded = {"model": root.state_dict(), "optim": root.gather_full_optim_state_dict(optim), "extra": extra}
    for step in range(SAVE_AT, TOTAL):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    model_state = root.state_dict() if flatten else None  # fairscale's state_dict() and unflat unused params
    return {**loaded, "final_model": model_state, "final_optim": root.gather_full_optim_state_dict(optim)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("whole") / "step3"
    reference = run_ranks(_save, 2, str(out), False)[0]
    return out, reference


def _skip_unused(name: str) -> bool:
    return name.startswith("unused.")  # a flat parameter gives a never-used parameter state a plain one lacks


@pytest.mark.parametrize(
    "world_size, nesting, flatten",
    [(2, "deep", True), (1, "deep", True), (3, "shallow", False), (4, "shallow", True)],
    ids=["same_W", "W1", "W3_shallow_unflat", "W4_shallow"],
)
def test_resume_whole_state(saved, world_size: int, nesting: str, flatten: bool) -> None:
    path, reference = saved
    results = run_ranks(_resume, world_size, str(path), nesting, flatten)
    first = results[0]
    assert sorted(first["model"]) == sorted(reference["model"])
    for key in reference["model"]:
        assert_identical(first["model"][key], reference["model"][key], key)
    def content(full: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in full.items() if k != "fsdp_optim"}  # its header names the world size

    assert_identical(content(first["optim"]), content(reference["optim"]), "optim")
    for rank, result in enumerate(results):
        assert_identical(result["extra"], _extra(rank % 2), f"extra of rank {rank}")
    net, plain = M.train_plain("adam", range(TOTAL), net=make_net())
    full = first["final_optim"]
    assert_full_matches_plain(full, plain.state_dict(), skip=_skip_unused, rel=REL)
    for key, value in net.state_dict().items() if first["final_model"] is not None else ():
        if key.endswith("seen"):  # a buffer the loop changed before saving: the loaded value, not the initial
            assert_identical(first["final_model"][key], value + 10.0, key)
        elif not _skip_unused(key):
            atol = REL * float(value.abs().max())
            torch.testing.assert_close(first["final_model"][key], value, rtol=REL, atol=atol)
