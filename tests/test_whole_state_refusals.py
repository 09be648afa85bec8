"""A whole-checkpoint load that fails on any rank raises on every rank and changes nothing anywhere: no
parameter, buffer or optimizer state, on the failing rank or the others (the ranks agree before anything is
copied). Cases: a damaged rank file of one rank, a model with another buffer, an optimizer of another class,
an optimizer-only checkpoint, a checkpoint saved without an optimizer loaded with one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import _models as M
import torch
import torch.distributed as dist
from _checks import assert_identical, snapshot
from _dist import run_ranks
from test_whole_state import make_net

import fsdp_optim


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _state(root: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in root.parameters()],
        "buffers": {n: b.clone() for n, b in root.named_buffers()},
        "optim": snapshot(optim.state_dict()),
    }


def _prepare(rank: int, world_size: int, out: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    root = M.wrap(make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, out / "good", extra={"rank": rank})
    fsdp_optim.save_checkpoint(root, None, out / "model_only")
    fsdp_optim.save_sharded_optim_state(root, optim, out / "optim_only")
    if rank == 0:
        shutil.copytree(out / "good", out / "damaged")
        _flip_last_byte(next((out / "damaged").glob("optim-*-rank00001-of-00002.safetensors")))
    dist.barrier()
    return root, optim


def _refusals(rank: int, world_size: int, out_dir: str) -> dict[str, str]:
    out = Path(out_dir)
    root, optim = _prepare(rank, world_size, out)
    M.train_step(root, optim, *M.local_batch(1, rank, world_size))  # the live state now differs from "good"
    other_buffer = M.wrap(make_net(), "deep")
    other_buffer.module.register_buffer("extra_buffer", torch.zeros(3))
    sgd = torch.optim.SGD(root.parameters(), lr=0.1)
    wider = make_net()
    wider.block1.add_module("extra", torch.nn.Linear(2, 2))  # a parameter the checkpoint does not have
    wider = M.wrap(wider, "deep")
    double = M.wrap(make_net().half(), "deep", compute_dtype=torch.float16)  # every parameter in another dtype
    cases = {
        "damaged": (root, optim, out / "damaged"),
        "other_buffer": (other_buffer, M.OPTIMIZERS["adam"](M.fsdp_param_groups(other_buffer)), out / "good"),
        "other_optimizer": (root, sgd, out / "good"),
        "optimizer_only": (root, optim, out / "optim_only"),
        "model_only_with_optim": (root, optim, out / "model_only"),
        "other_model": (wider, M.OPTIMIZERS["adam"](M.fsdp_param_groups(wider)), out / "good"),
        "other_dtype": (double, M.OPTIMIZERS["adam"](M.fsdp_param_groups(double)), out / "good"),
    }
    errors = {}
    for name, (model, opt, path) in cases.items():
        before = _state(model, opt)
        try:
            fsdp_optim.load_checkpoint(model, opt, path)
            errors[name] = "loaded"
        except ValueError as exc:
            errors[name] = str(exc)
        after = _state(model, opt)
        assert_identical(after, before, f"rank {rank}, {name}: state changed by a refused load")
    assert fsdp_optim.load_checkpoint(root, None, out / "model_only") is None  # the model alone loads
    return errors


EXPECTED = {
    "damaged": "rank00001",
    "other_buffer": "extra_buffer",
    "other_optimizer": "saved from Adam, found SGD",
    "optimizer_only": "load_sharded_optim_state",
    "model_only_with_optim": "optim=None",
    "other_model": "block1.extra.weight",
    "other_dtype": "float16",
}


def test_a_refused_load_raises_on_every_rank_and_changes_nothing(tmp_path) -> None:
    results = run_ranks(_refusals, 2, str(tmp_path))
    for name, needle in EXPECTED.items():
        messages = [r[name] for r in results]
        assert all(needle in m for m in messages), (name, messages)
        first = min(messages, key=len)  # the failing rank's own message; the others add where it was raised
        assert all(m.startswith(first.split(" [raised on rank")[0]) for m in messages), (name, messages)
    assert os.path.exists(tmp_path / "damaged" / "manifest.json")


def _side_write_fails_on_rank_1(rank: int, world_size: int, out: str) -> str:
    from fsdp_optim.job import whole_save

    root = M.wrap(make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    if rank == 1:  # a disk that fails under one rank's side file alone, after its rank file was written

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "no space left on device (injected)")

        whole_save.write_side_file = fail  # type: ignore[assignment]
    try:
        fsdp_optim.save_checkpoint(root, optim, out)
    except OSError as exc:
        return str(exc)
    return "saved"


def test_a_side_file_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path) -> None:
    out = tmp_path / "ckpt"
    messages = run_ranks(_side_write_fails_on_rank_1, 2, str(out))
    assert all("injected" in m for m in messages), messages
    assert not (out / "manifest.json").exists() and not list(out.glob("*.safetensors")), sorted(out.iterdir())
