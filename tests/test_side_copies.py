"""Buffers and ``extra`` at the floor: a sync save writes them from where they are (no copy on the host; a GPU's
through the stager's pinned ring), an async save copies each once at the call, and the side file is streamed (its
header, then each tensor's bytes, hashed while written), never built in memory. Real files, real process groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _allocations import HostAllocations
from _checks import assert_identical
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.side_file import encode_extra, read_side_file, write_side_file

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (copies from GPU memory)")
BIG = 1 << 20  # elements of the large buffer and extra tensor: 4 MiB each, far above anything else a save makes


def test_a_streamed_side_file_reads_back_exactly_whatever_its_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    buffers = {"norm.mean": torch.randn(5, generator=g), "count": torch.tensor(7), "mask": torch.rand(9, generator=g) > 0.5,
               "empty": torch.zeros(0, 3), "strided": base.t()}  # fmt: skip
    extra = {"rng": torch.Generator().manual_seed(3).get_state(), "z": torch.randn(4, dtype=torch.complex64),
             "half": torch.randn(3, generator=g).half(), "step": 12, "$odd": (1, None)}  # fmt: skip
    record = write_side_file(tmp_path, save_id="s", rank=0, world_size=1, buffers=buffers, extra=encode_extra(extra))
    back_buffers, back_extra = read_side_file(where(tmp_path), record)
    assert_identical(dict(sorted(back_buffers.items())), {k: buffers[k].contiguous() for k in sorted(buffers)}, "buffers")
    assert_identical(back_extra, extra, "extra")
    from safetensors import safe_open

    with safe_open(str(tmp_path / record.file), framework="pt") as f:  # any safetensors reader opens it
        assert torch.equal(f.get_tensor("buffers/strided"), base.t()), "safetensors reads another value"


def test_a_side_file_refuses_a_dtype_safetensors_cannot_hold_and_writes_nothing(tmp_path: Path) -> None:
    extra = encode_extra({"z": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(TypeError, match=r"extra/0: a torch.complex128 tensor"):
        write_side_file(tmp_path, save_id="s", rank=0, world_size=1, buffers={}, extra=extra)
    assert not list(tmp_path.iterdir()), f"a refused side file left {list(tmp_path.iterdir())}"


def _net(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    net.register_buffer("big", torch.randn(BIG))
    return net.to(device)


def _saves(rank: int, world_size: int, out: str, device: str) -> dict[str, Any]:  # noqa: ARG001
    root = fsdp_optim.FullyShardedDataParallel(_net(device))
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    root(torch.randn(2, 16, device=device)).sum().backward()
    optim.step()
    extra = {"step": 1, "big": torch.randn(BIG, device=device)}
    fsdp_optim.save_checkpoint(root, optim, f"{out}/warm", extra=extra)  # (a GPU's ring is made here)
    with HostAllocations() as sync:
        fsdp_optim.save_checkpoint(root, optim, f"{out}/sync", extra=extra)
    with HostAllocations() as call:
        handle = fsdp_optim.async_save_checkpoint(root, optim, f"{out}/async", extra=extra)
    handle.wait()
    loaded = {}
    for kind in ("sync", "async"):
        root.module.big.zero_()
        back = fsdp_optim.load_checkpoint(root, optim, f"{out}/{kind}")
        loaded[kind] = torch.equal(back["big"].cpu(), extra["big"].cpu()) and torch.equal(root.module.big, extra_buffer(device))
    return {"sync": sync.above(BIG * 4 - 1), "async call": call.above(BIG * 4 - 1), "loaded": loaded}


def extra_buffer(device: str) -> torch.Tensor:
    return _net(device).big


def _check(result: dict[str, Any]) -> None:
    assert result["loaded"] == {"sync": True, "async": True}, f"buffer or extra not back as saved: {result['loaded']}"
    assert result["sync"] == [], f"a sync save copied a 4 MiB buffer or extra tensor on the host: {result['sync']}"
    assert result["async call"] == [BIG * 4, BIG * 4], f"an async save's call copies each once: {result['async call']}"


def test_a_sync_save_copies_no_buffer_or_extra_and_an_async_save_copies_each_once(tmp_path: Path) -> None:
    (result,) = run_ranks(_saves, 1, str(tmp_path), "cpu")
    _check(result)


@CUDA
def test_on_a_gpu_buffers_and_extra_reach_the_host_once_and_a_sync_save_only_through_the_pinned_ring(tmp_path: Path) -> None:
    (result,) = run_ranks(_saves, 1, str(tmp_path), "cuda", backend="nccl")
    _check(result)
