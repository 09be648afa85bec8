"""The DCP writer of ``to_dcp`` (formats/dcp.py): one data file, read exactly by DCP, one tensor alive at a time,
and a killed export cleaned up by the next.

Real files, torch's own readers (``dcp.load``, ``dcp_to_torch_save``), a real ``SIGKILL``; nothing is mocked.
The memory bound is checked structurally: each produced tensor's memory is a numpy array watched through a weak
reference (it lives as long as any tensor sharing that storage: a ``detach()`` copy of the tensor object keeps
it too), and when the writer asks for the next tensor, none of the earlier ones may still be alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dist_cp
from _checks import assert_identical
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdp_optim
from fsdp_optim.formats.dcp import DATA_FILE, METADATA, _LazyPlanner, write_dcp

SHAPES = [(7, 5), (5,), (3, 4, 2), (11, 6), (1,)]


class Produced:
    """Producers of deterministic tensors that record, at each call, how many earlier tensors are alive."""

    def __init__(self) -> None:
        self.made: list[weakref.ref[np.ndarray]] = []
        self.alive_when_asked: list[int] = []

    def maker(self, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            self.alive_when_asked.append(sum(ref() is not None for ref in self.made))
            memory = expected_tensor(i, shape, dtype).reshape(-1).view(torch.uint8).numpy().copy()
            self.made.append(weakref.ref(memory))
            return torch.from_numpy(memory).view(dtype).view(shape)

        return make


def expected_tensor(i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)


def lazy_state(produced: Produced) -> tuple[dict[str, Any], dict[int, Callable[[], torch.Tensor]], dict[str, Any]]:
    """``({"optim": {"state": {name: {"exp_avg": placeholder, "step": 3.}}, "param_groups": [...]}}, producers,
    the same dict with the real tensors)``."""
    producers: dict[int, Callable[[], torch.Tensor]] = {}
    state: dict[str, Any] = {}
    real: dict[str, Any] = {}
    for i, shape in enumerate(SHAPES):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        placeholder = torch.zeros((), dtype=dtype).expand(shape)
        producers[id(placeholder)] = produced.maker(i, shape, dtype)
        state[f"p{i}"] = {"exp_avg": placeholder, "step": torch.tensor(3.0)}
        real[f"p{i}"] = {"exp_avg": expected_tensor(i, shape, dtype), "step": torch.tensor(3.0)}
    groups = [{"lr": 0.1, "params": [f"p{i}" for i in range(len(SHAPES))]}]
    return {"optim": {"state": state, "param_groups": groups}}, producers, {"optim": {"state": real, "param_groups": groups}}


def test_one_data_file_one_tensor_alive_at_a_time(tmp_path) -> None:
    produced = Produced()
    state, producers, expected = lazy_state(produced)
    write_dcp(state, producers, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == [METADATA, DATA_FILE]
    assert produced.alive_when_asked == [0] * len(SHAPES), produced.alive_when_asked
    dcp_to_torch_save(tmp_path / "out", tmp_path / "back.pt")
    assert_identical(torch.load(tmp_path / "back.pt", weights_only=False), expected)


def test_dcp_load_reads_it_exactly(tmp_path) -> None:
    state, producers, expected = lazy_state(Produced())
    write_dcp(state, producers, tmp_path / "out")
    target = {"optim": {"state": {name: {k: torch.zeros_like(v) for k, v in entries.items()}
                                  for name, entries in expected["optim"]["state"].items()},
                        "param_groups": [{"lr": 0.0, "params": None}]}}  # fmt: skip
    dist_cp.load(target, checkpoint_id=tmp_path / "out", no_dist=True)
    assert_identical(target, expected)


def test_the_alive_count_sees_a_writer_that_keeps_tensors(tmp_path) -> None:
    """The check has teeth: DCP's own writer with one file per rank keeps every tensor of that file."""
    produced = Produced()
    state, producers, _ = lazy_state(produced)
    writer = FileSystemWriter(tmp_path / "torch", single_file_per_rank=True, thread_count=1)
    dist_cp.save(state, storage_writer=writer, planner=_LazyPlanner(producers), no_dist=True)
    assert produced.alive_when_asked == list(range(len(SHAPES))), produced.alive_when_asked


def _full_dict(layers: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    state = {i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(8, 4, generator=g),
                 "exp_avg_sq": torch.rand(8, 4, generator=g)} for i in range(layers)}  # fmt: skip
    return {
        "state": state,
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                          "params": list(range(layers))}],  # fmt: skip
        "param_names": {i: f"layers.{i}.weight" for i in range(layers)},
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 2, "scalar_keys": ["step"]},
    }


_KILLED_EXPORT = """
import os, signal, sys
import fsdp_optim
made = []
def progress():
    made.append(1)
    if len(made) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
fsdp_optim.to_dcp(sys.argv[1], sys.argv[2], progress=progress)
"""


@pytest.mark.parametrize("after", [1, 4])
def test_a_killed_export_is_cleaned_up_by_the_next(tmp_path, after: int) -> None:
    full = _full_dict(3)
    torch.save(full, tmp_path / "full.pt")
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, str(tmp_path / "full.pt"), str(out), str(after)],
                            capture_output=True, text=True)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    staging = [p for p in tmp_path.iterdir() if ".fsdp-optim-staging." in p.name]
    assert len(staging) == 1 and DATA_FILE in os.listdir(staging[0]), sorted(os.listdir(tmp_path))
    assert not out.exists()
    fsdp_optim.to_dcp(tmp_path / "full.pt", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "out"]
    assert sorted(os.listdir(out)) == [METADATA, DATA_FILE]
    dcp_to_torch_save(out, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=False)["optimizer"]["state"]
    assert_identical(back, {f"layers.{i}.weight": entries for i, entries in full["state"].items()})


def test_a_failed_export_leaves_nothing(tmp_path) -> None:
    def fail_on_third(state: list[int] = []) -> None:  # noqa: B006 - a counter kept by the callback
        state.append(1)
        if len(state) == 3:
            raise OSError("disk full (injected by the caller's progress callback)")

    with pytest.raises(CheckpointException, match="disk full"):  # DCP's wrapper of an error in its steps
        fsdp_optim.to_dcp(_full_dict(3), tmp_path / "out", progress=fail_on_third)
    assert sorted(os.listdir(tmp_path)) == []

