"""fairscale's CPU offload on a GPU (``mixed_precision=True, move_params_to_cpu=True``), through our class: it computes
on the GPU as fairscale does (the shards and the optimizer stay on the CPU), saves, loads at world size 1 into a
fresh model, and goes on bit-exact against the run that was never interrupted.

Before the fix this model took fairscale's CPU path on a GPU machine (decided by where its parameters sit), trained on
the CPU, and refused every GPU instance built later in the process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

OPTIONS = {"mixed_precision": True, "move_params_to_cpu": True}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: CPU offload computes there")


def _steps(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    import _models as M

    for step in steps:
        M.train_step(model, optim, *(t.cuda() for t in M.local_batch(step, 0, 1)))


def _offload_resume(rank: int, world_size: int, out: str) -> dict[str, Any]:  # noqa: ARG001
    import _models as M

    import fsdp_optim
    from fsdp_optim.job import host

    torch.use_deterministic_algorithms(True, warn_only=True)  # the same kernels give the same bits in both runs
    model = M.wrap(M.make_net(0), "deep", **OPTIONS)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _steps(model, optim, range(3))
    fsdp_optim.save_checkpoint(model, optim, out, extra={"step": 3})
    _steps(model, optim, range(3, 6))  # the uninterrupted run

    fresh = M.wrap(M.make_net(1), "deep", **OPTIONS)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    extra = fsdp_optim.load_checkpoint(fresh, fresh_optim, out)
    _steps(fresh, fresh_optim, range(3, 6))
    want, got = model.state_dict(), fresh.state_dict()
    a, b = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    return {
        "extra": extra,
        "host path": host.is_enabled(),
        "compute": {str(m.compute_device) for m in fresh.modules() if hasattr(m, "compute_device")},
        "params": {p.device.type for p in fresh.parameters()},
        "weights": sorted(k for k in want if not torch.equal(want[k].cpu(), got[k].cpu())),
        "optimizer": sorted(f"{i}.{k}" for i in a for k in a[i] if not torch.equal(a[i][k], b[i][k])),
    }


@CUDA
def test_cpu_offload_computes_on_the_gpu_and_resumes_bit_exact(tmp_path, monkeypatch) -> None:
    from _dist import run_ranks

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, read when the rank starts it

    (found,) = run_ranks(_offload_resume, 1, str(tmp_path / "ckpt"), backend="nccl")
    assert found["extra"] == {"step": 3}, found
    assert not found["host path"] and all(d.startswith("cuda") for d in found["compute"]), f"computed on: {found}"
    assert found["params"] == {"cpu"}, f"offloaded shards stay on the CPU: {found}"
    assert not found["weights"] and not found["optimizer"], f"differ from the uninterrupted run: {found}"
