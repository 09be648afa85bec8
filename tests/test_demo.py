"""The demo (``torchrun ... -m fsdp_optim.demo``) leaves nothing in the temp dir when no ``--out`` was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_optim.demo import choose_device

ROOT = Path(__file__).resolve().parent.parent


def _pythonpath() -> str:
    """This checkout first, then what the caller's PYTHONPATH holds (a GPU machine carries fairscale there)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def _demo(tmp_path: Path, ranks: int, steps: int) -> str:
    """The README's main job under torchrun, in ``tmp_path`` as its temp dir; its stdout, checked to have passed."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": _pythonpath()}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "-m", "fsdp_optim.demo", "--steps", str(steps), "--repeats", "1"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "continuity verified" in done.stdout, done.stdout[-2000:]
    losses = [line for line in done.stdout.splitlines() if "largest relative difference from the uninterrupted" in line]
    assert len(losses) == 2 and all(line.endswith("-> OK") for line in losses), done.stdout[-2000:]
    return done.stdout


def test_demo_removes_its_temporary_directory(tmp_path: Path) -> None:
    first = _demo(tmp_path, 2, 1).splitlines()[0]
    on_gpus = torch.cuda.device_count() >= 2
    assert first.startswith(f"fsdp_optim demo on {'GPUs (nccl)' if on_gpus else 'the CPU (gloo)'}: "), first
    left = sorted(p.name for p in tmp_path.glob("fsdp_optim_demo_*"))
    assert not left, f"the demo left {left} in the temp dir"


def test_the_demo_takes_a_gpu_per_local_rank_or_the_cpu_and_says_why() -> None:
    gpus = torch.cuda.device_count()
    device, backend, why = choose_device("auto", gpus + 1)  # one local rank more than there are GPUs
    assert (device.type, backend) == ("cpu", "gloo"), (device, backend)
    assert why == (f"{gpus} GPU(s) for {gpus + 1} local ranks: NCCL needs one GPU per rank" if gpus else "no GPU here")
    assert choose_device("cpu", 1)[:2] == (torch.device("cpu"), "gloo")
    with pytest.raises(SystemExit, match=rf"--device cuda: expected a GPU for each of the {gpus + 1} local ranks"):
        choose_device("cuda", gpus + 1)
    if gpus:
        assert choose_device("auto", 1)[1] == "nccl"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the demo on one GPU under NCCL")
def test_demo_on_one_gpu_trains_saves_and_resumes_there(tmp_path: Path) -> None:
    out = _demo(tmp_path, 1, 2)
    assert out.startswith("fsdp_optim demo on GPUs (nccl): "), out[:200]
