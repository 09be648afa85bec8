"""An async save's blocking part reads no tensor's value on the host: under NCCL a GPU scalar's ``.item()`` (or an
agreement's ``.tolist()`` of a GPU tensor) waits for all the GPU work queued before it, so the caller would wait for
its GPU. The optimizer's 0-dim state is read from the save's own copy in the background; the agreements of the
blocking part run on the save's gloo group.

Here the scalars are tripwires (a tensor subclass, not a collective nor an FSDP internal) whose host reads raise in
the thread that called the save, while the call runs: before the fix ``step.item()`` raised there. The CUDA test queues
a long kernel, calls the save, and checks that the kernel is still running when the call returns.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import _models as M
import pytest
import torch
from _checks import assert_identical, snapshot
from _dist import run_ranks

import fsdp_optim

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.to,
          torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}  # fmt: skip


class Tripwire(torch.Tensor):
    """A state scalar that the armed thread may not read on the host (what would sync it with a GPU)."""

    armed: ClassVar[int | None] = None  # the thread whose reads raise

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _READS and cls.armed == threading.get_ident():
            raise AssertionError(f"Tensor.{func.__name__} read a state scalar in an async save's blocking part")
        with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors
            return func(*args, **(kwargs or {}))


def _blocking_part_reads_nothing(rank: int, world_size: int, out: str) -> str:
    model = M.wrap(M.make_net(0), "deep")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    at_call = snapshot(optim.state_dict())
    for state in optim.state.values():
        state["step"] = state["step"].as_subclass(Tripwire)
    Tripwire.armed = threading.get_ident()
    try:
        with pytest.raises(AssertionError, match="blocking part"):
            next(iter(optim.state.values()))["step"].item()  # the tripwire works
        whole = fsdp_optim.async_save_checkpoint(model, optim, f"{out}/whole", extra={"step": 2})
        whole.wait_staged()
        sharded = fsdp_optim.async_save_sharded_optim_state(model, optim, f"{out}/sharded")
    finally:
        Tripwire.armed = None
    whole.wait()
    sharded.wait()
    fresh = M.wrap(M.make_net(1), "deep")
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert fsdp_optim.load_checkpoint(fresh, fresh_optim, f"{out}/whole") == {"step": 2}, "extra"
    assert_identical(fresh_optim.state_dict(), at_call, f"rank {rank}: whole checkpoint")
    other = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fsdp_optim.load_sharded_optim_state(fresh, other, f"{out}/sharded")
    assert_identical(other.state_dict(), at_call, f"rank {rank}: optimizer checkpoint")
    return "ok"


def test_an_async_saves_blocking_part_reads_no_state_scalar(tmp_path) -> None:
    assert run_ranks(_blocking_part_reads_nothing, 2, str(tmp_path)) == ["ok", "ok"]


def _memory_tier_blocking_part_reads_nothing(rank: int, world_size: int, out: str) -> bool:
    from pathlib import Path

    from fsdp_optim.job.memory import memory_tier, save_to_memory

    model = M.wrap(M.make_net(0), "deep")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    for state in optim.state.values():
        state["step"] = state["step"].as_subclass(Tripwire)
    tier = memory_tier(Path(out) / "root", memory_dir=f"{out}/memory", node=rank, replicas=0, keep=1, rank=rank)
    Tripwire.armed = threading.get_ident()
    try:
        handle = save_to_memory(model, optim, tier, 2, extra={"step": 2})
        assert not isinstance(handle, Path), "with an optimizer the memory tier saves in the background"
        handle.wait_staged()
    finally:
        Tripwire.armed = None
    return Path(handle.wait()).is_dir()


def test_a_memory_tier_saves_blocking_part_reads_no_state_scalar_and_agrees_over_the_gloo_group(tmp_path) -> None:
    assert run_ranks(_memory_tier_blocking_part_reads_nothing, 2, str(tmp_path)) == [True, True]


def _queued_work_outlives_the_call(rank: int, world_size: int, out: str) -> dict[str, Any]:
    model = M.wrap(M.make_net(0).cuda(), "deep")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)  # its step on the GPU
    for step in range(2):
        M.train_step(model, optim, *(t.cuda() for t in M.local_batch(step, rank, world_size)))
    fsdp_optim.async_save_checkpoint(model, optim, f"{out}/warm").wait()  # groups and staging made once
    at_call = snapshot(optim.state_dict())
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # about 2 s of queued GPU work on the caller's stream
    handle = fsdp_optim.async_save_checkpoint(model, optim, f"{out}/async", extra={"step": 2})
    queued = not stream.query()  # the call returned while the GPU still ran what came before it
    handle.wait()
    fresh = M.wrap(M.make_net(1).cuda(), "deep")
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2, capturable=True)
    fsdp_optim.load_checkpoint(fresh, fresh_optim, f"{out}/async")
    assert_identical(snapshot(fresh_optim.state_dict()), at_call, "the state at the call")
    return {"still queued after the call": queued}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: NCCL, GPU state scalars")
def test_an_async_save_under_nccl_does_not_wait_for_the_gpu(tmp_path) -> None:
    (found,) = run_ranks(_queued_work_outlives_the_call, 1, str(tmp_path), backend="nccl")
    assert found == {"still queued after the call": True}, found
