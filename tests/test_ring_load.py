"""Loads at the floor (:mod:`fsdp_optim.job.ring_load`): a rank file read a piece at a time into a ring's slots, each
piece checked on its slot, then copied out while the next is read.

Here the ring copies into host memory (its copier is :class:`~fsdp_optim.job.stager.HostCopier`, or the suite's
asynchronous copier, ``tests/_async_copier.py``, whose copies land late on a worker thread); on a GPU the same code copies into device memory (the CUDA test at the end).
Real process groups (gloo), real fairscale FSDP, real training steps and real files."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _allocations import HostAllocations
from _async_copier import AsyncCopier
from _checks import assert_identical, snapshot
from _dist import run_ranks
from _forge import manifest_rank_file

import fsdp_optim
from fsdp_optim.formats.sharded.piece_reads import TensorPiece
from fsdp_optim.formats.sharded.segments import Grid, Placement
from fsdp_optim.job import ring_load
from fsdp_optim.job.stager import Ring

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (copies into GPU memory)")
SLOT = 3 << 16  # three 64 KiB checksum chunks: a rank file of the model below is many pieces


def _pieces(total: int, step: int, cuts: list[int]) -> tuple[list[TensorPiece], list[Placement]]:
    """Pieces of ``step`` elements over a float32 tensor of ``total`` elements cut into shards at ``cuts``."""
    bounds = [0, *cuts, total]
    grid = Grid("float32", 0, total, ())
    shards = [Placement(k, "exp_avg", "float32", a, b - a, grid) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    pieces = []
    for lo in range(0, total, step):
        hi = min(lo + step, total)
        pieces.append(TensorPiece("float32", torch.float32, lo, hi, tuple(s for s in shards if s.offset < hi and s.offset + s.numel > lo)))
    return pieces, shards


def _fill(piece: TensorPiece, slot: torch.Tensor) -> None:
    slot.view(torch.float32).copy_(torch.arange(piece.lo, piece.hi, dtype=torch.float32))


def test_each_slot_is_read_checked_and_copied_in_turn_and_refilled_once_its_late_copies_landed() -> None:
    total, step = 10_000, 256
    pieces, shards = _pieces(total, step, [1, 700, 701, 5_003, 9_998])
    into = {(s.flat, s.key): torch.full((s.numel,), -1.0) for s in shards}
    copier = AsyncCopier()
    ring = Ring(copier, slots=3, slot_bytes=step * 4)
    checked: list[int] = []

    def check(piece: TensorPiece, slot: torch.Tensor) -> None:  # sees the slot as the reader filled it
        assert torch.equal(slot.view(torch.float32), torch.arange(piece.lo, piece.hi, dtype=torch.float32)), piece.lo
        checked.append(piece.lo)

    ring_load.stream_pieces(ring, pieces, [_fill, check], lambda p, slot: ring_load._copies(into, p, slot))
    assert checked == [p.lo for p in pieces], f"pieces checked out of order or twice: {checked[:8]}"
    assert copier.in_flight() == 0, f"{copier.in_flight()} copies still in flight after the stream returned"
    whole = torch.cat([into[(s.flat, s.key)] for s in shards])
    assert torch.equal(whole, torch.arange(total, dtype=torch.float32)), "a slot was refilled before its copy landed"


@pytest.mark.parametrize("failing", ["read", "check"])
def test_a_failure_is_raised_after_every_thread_stopped_and_every_copy_landed(failing: str) -> None:
    pieces, shards = _pieces(4_000, 100, [1_234])
    into = {(s.flat, s.key): torch.zeros(s.numel) for s in shards}
    copier = AsyncCopier(seed=1)
    ring = Ring(copier, slots=4, slot_bytes=400)
    read: list[int] = []

    def fill(piece: TensorPiece, slot: torch.Tensor) -> None:
        if failing == "read" and piece.lo == 1_700:
            raise OSError("the file ended early")
        _fill(piece, slot)
        read.append(piece.lo)

    def check(piece: TensorPiece, slot: torch.Tensor) -> None:  # noqa: ARG001
        if failing == "check" and piece.lo == 1_700:
            raise ValueError("checksum mismatch in elements 1700..1800 (file is corrupt or was modified)")

    with pytest.raises(OSError if failing == "read" else ValueError):
        ring_load.stream_pieces(ring, pieces, [fill, check], lambda p, slot: ring_load._copies(into, p, slot))
    assert copier.in_flight() == 0, "the error came back while copies out of the slots were still landing"
    assert max(read) < 1_700 + 4 * 100, f"the reader went on past the failed piece: {read[-3:]}"
    copied = torch.cat([into[(s.flat, s.key)] for s in shards])
    assert not copied[1_700:].any(), "the failed piece, or one after it, was copied out"
    assert not [t for t in threading.enumerate() if t.name.startswith("fsdp_optim-load")], "a thread outlived the load"


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128))


def _train(root: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = root(torch.randn(8, 128, generator=g)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def _round_trip(rank: int, world_size: int, out: str) -> dict[str, Any]:
    copier = AsyncCopier(seed=rank)
    ring_load.ring_for = lambda device: Ring(copier, slots=3, slot_bytes=SLOT)  # the ring's path, on the host
    root = fsdp_optim.FullyShardedDataParallel(_net())
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    for step in range(2):
        _train(root, optim, step, rank)
    ckpt = Path(out) / "ckpt"
    fsdp_optim.save_checkpoint(root, optim, ckpt, extra={"step": 2})
    saved = {"model": snapshot(root.state_dict()), "optim": snapshot(optim.state_dict())}
    _train(root, optim, 2, rank)  # the live state now differs from the saved one
    state_bytes = sum(p.numel() * 4 * 3 for p in root.parameters())  # weights, exp_avg, exp_avg_sq
    with HostAllocations() as seen:
        extra = fsdp_optim.load_checkpoint(root, optim, ckpt)
    assert_identical(root.state_dict(), saved["model"], f"rank {rank}: the weights after a load through the ring")
    assert_identical(optim.state_dict(), saved["optim"], f"rank {rank}: the optimizer after a load through the ring")
    return {"extra": extra, "copied": copier.bytes_landed, "state": state_bytes, "large": seen.above(SLOT)}


def test_a_load_through_the_ring_is_bit_exact_and_reads_the_state_once(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_round_trip, 2, str(tmp_path))):
        assert result["extra"] == {"step": 2}, result["extra"]
        assert result["copied"] == result["state"], f"rank {rank}: {result['copied']} bytes left the slots, expected the state's {result['state']}"
        # The only host memory above a slot made during the load is the new state itself (here on the host; on a
        # GPU it is the GPU's): never a copy of the rank file, or of the state, in pageable memory beside it.
        assert sum(result["large"]) <= result["state"], f"rank {rank}: host allocations {result['large']} for a state of {result['state']} bytes"


def _in_place(rank: int, world_size: int, out: str) -> dict[str, bool]:  # noqa: ARG001
    ring_load.ring_for = lambda device: Ring(AsyncCopier(seed=rank + 7), slots=2, slot_bytes=SLOT)
    root = fsdp_optim.FullyShardedDataParallel(_net())
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    _train(root, optim, 0, rank)
    fsdp_optim.save_checkpoint(root, optim, Path(out) / "ckpt")
    saved = snapshot(optim.state_dict())
    _train(root, optim, 1, rank)
    live = {"params": [p.data_ptr() for p in root.parameters()],
            "optim": {(pid, k): v for pid, e in optim.state_dict()["state"].items() for k, v in e.items() if v.dim()}}  # fmt: skip
    fsdp_optim.load_checkpoint(root, optim, Path(out) / "ckpt")
    assert_identical(optim.state_dict(), saved, f"rank {rank}: the optimizer after a load through the ring")
    now = optim.state_dict()["state"]
    return {"params": [p.data_ptr() for p in root.parameters()] == live["params"],
            "optim": all(now[pid][k] is t for (pid, k), t in live["optim"].items())}  # fmt: skip


def test_a_load_through_the_ring_under_late_copies_lands_in_the_live_tensors_in_place(tmp_path: Path) -> None:
    """The one rule for where loaded state lands (job/ring_load.py): in the live tensors, in place."""
    assert run_ranks(_in_place, 2, str(tmp_path)) == [{"params": True, "optim": True}] * 2


def _load_memory(rank: int, world_size: int, out: str) -> dict[str, int]:  # noqa: ARG001
    ring = Ring(AsyncCopier(seed=rank + 3), slots=2, slot_bytes=SLOT)
    ring_load.ring_for = lambda device: ring  # the ring's path on the host: the host stands for the GPU's memory
    torch.manual_seed(0)
    root = fsdp_optim.FullyShardedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]))
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    for step in range(2):
        loss = root(torch.randn(8, 512, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    fsdp_optim.save_checkpoint(root, optim, Path(out) / "ckpt")
    saved = {"model": snapshot(root.state_dict()), "optim": snapshot(optim.state_dict())}
    optim.step()  # the live state now differs from the saved one
    with HostAllocations() as seen:
        fsdp_optim.load_checkpoint(root, optim, Path(out) / "ckpt")
    assert_identical(root.state_dict(), saved["model"], f"rank {rank}: the weights")
    assert_identical(optim.state_dict(), saved["optim"], f"rank {rank}: the optimizer")
    return {"state": sum(p.numel() * 4 * 3 for p in root.parameters()), "allocated": sum(seen.sizes), "largest": max(seen.sizes, default=0)}


def test_a_load_at_the_saved_layout_verifies_then_lands_in_place_growing_memory_by_less_than_a_slot(tmp_path: Path) -> None:
    """N3, modelled on the host: the load's memory (the GPU's, here the host's) grows by less than one ring slot over
    the live state (the bound on a GPU: a slot + 64 MiB), all or nothing kept (a verify pass, agreement, a pass that
    lands in the live tensors: tests/test_ring_load.py's refused load changes nothing)."""
    for rank, result in enumerate(run_ranks(_load_memory, 2, str(tmp_path))):
        assert result["allocated"] < SLOT < result["state"] / 10, f"rank {rank}: {result}"


def _damaged(rank: int, world_size: int, out: str) -> tuple[str, str]:
    ring_load.ring_for = lambda device: Ring(AsyncCopier(seed=rank), slots=2, slot_bytes=SLOT)
    root = fsdp_optim.FullyShardedDataParallel(_net())
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    _train(root, optim, 0, rank)
    ckpt = Path(out) / "ckpt"
    fsdp_optim.save_checkpoint(root, optim, ckpt)
    _train(root, optim, 1, rank)
    victim = manifest_rank_file(ckpt, 1)
    if rank == 0:  # one byte near the end of rank 1's data: pieces before it were read and copied out already
        raw = bytearray(victim.read_bytes())
        raw[-100] ^= 0xFF
        victim.write_bytes(bytes(raw))
    dist.barrier()
    before = {"model": snapshot(root.state_dict()), "optim": snapshot(optim.state_dict())}
    raised = "nothing raised"
    try:
        fsdp_optim.load_checkpoint(root, optim, ckpt)
    except ValueError as exc:
        raised = str(exc)
    assert_identical(root.state_dict(), before["model"], f"rank {rank}: the weights after a refused load")
    assert_identical(optim.state_dict(), before["optim"], f"rank {rank}: the optimizer after a refused load")
    return victim.name, raised


def test_a_corrupt_byte_read_through_the_ring_is_refused_on_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    (victim, raised0), (_, raised1) = run_ranks(_damaged, 2, str(tmp_path))
    assert victim in raised1 and "checksum mismatch" in raised1, raised1
    assert "[raised on rank 1;" in raised0, raised0


def _gpu_load(rank: int, world_size: int, out: str) -> dict[str, Any]:  # noqa: ARG001
    root = fsdp_optim.FullyShardedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda())
    optim = torch.optim.Adam(root.parameters(), lr=1e-3)
    loss = root(torch.randn(4, 1024, device="cuda")).square().mean()
    loss.backward()
    optim.step()
    fsdp_optim.save_checkpoint(root, optim, f"{out}/ckpt")
    saved = {"model": snapshot(root.state_dict()), "optim": snapshot(optim.state_dict())}
    fsdp_optim.load_checkpoint(root, optim, f"{out}/ckpt")  # the ring's pinned slots exist from here on
    optim.step()
    torch.cuda.synchronize()
    with HostAllocations() as seen:
        fsdp_optim.load_checkpoint(root, optim, f"{out}/ckpt")
    torch.cuda.synchronize()
    same = _as_saved(root, optim, saved)
    return {"exact": same, "host bytes above 1 MiB": sum(seen.above(1 << 20))}


def _as_saved(root: torch.nn.Module, optim: torch.optim.Optimizer, saved: dict[str, Any]) -> bool:
    """Whether the live model and optimizer hold exactly what ``saved`` snapshotted (``{"model", "optim"}``)."""
    try:
        assert_identical(root.state_dict(), saved["model"])
        assert_identical(optim.state_dict(), saved["optim"])
    except AssertionError:
        return False
    return True


@CUDA
def test_a_gpu_load_reads_through_the_pinned_ring_with_no_pageable_copy_of_the_state(tmp_path: Path) -> None:
    (result,) = run_ranks(_gpu_load, 1, str(tmp_path), backend="nccl")
    assert result == {"exact": True, "host bytes above 1 MiB": 0}, result  # a 96 MiB state, no host copy of it


def _gpu_load_memory(rank: int, world_size: int, out: str) -> dict[str, Any]:  # noqa: ARG001
    from fsdp_optim.job.ring_load import ring_for

    root = fsdp_optim.FullyShardedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda())
    optim = torch.optim.Adam(root.parameters(), lr=1e-3)
    root(torch.randn(4, 2048, device="cuda")).square().mean().backward()
    optim.step()
    fsdp_optim.save_checkpoint(root, optim, f"{out}/ckpt")
    saved = {"model": snapshot(root.state_dict()), "optim": snapshot(optim.state_dict())}
    optim.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    live = torch.cuda.memory_allocated()
    fsdp_optim.load_checkpoint(root, optim, f"{out}/ckpt")
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - live
    same = _as_saved(root, optim, saved)
    return {"exact": same, "growth": growth, "bound": ring_for(torch.device("cuda", 0)).slot_bytes + (64 << 20),
            "state": sum(p.numel() * 4 * 3 for p in root.parameters())}  # fmt: skip


@CUDA
def test_gpu_a_load_at_the_saved_layout_grows_gpu_memory_by_at_most_a_slot_and_64_mib(tmp_path: Path) -> None:
    (result,) = run_ranks(_gpu_load_memory, 1, str(tmp_path), backend="nccl")
    assert result["exact"] and result["growth"] <= result["bound"] < result["state"], result
