"""Scatter and full-dict loads under NCCL: what a rank receives arrives in its GPU memory and stays there (it went
GPU -> host per tensor, then back to the GPU through the pinned ring). On the CPU nothing changes (the scatter tests
of tests/test_checkpoint.py and tests/test_sharded_format.py keep their results).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: state received in GPU memory")
def test_state_already_on_its_parameters_gpu_is_taken_as_it_is() -> None:
    """optimizer_state_on_device, the one rule (job/ring_load.py): a tensor received on its parameter's GPU is
    memory of its own there and becomes the state as it is; one on the host crosses devices through the ring into the
    live state; the result loads exactly."""
    from fsdp_optim.job.ring_load import optimizer_state_on_device

    net = torch.nn.Linear(64, 32).cuda()
    optim = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 64, device="cuda")).sum().backward()
    optim.step()
    saved = optim.state_dict()
    want = {pid: {k: v.clone() for k, v in e.items()} for pid, e in saved["state"].items()}
    mixed = {pid: dict(e) for pid, e in saved["state"].items()}
    received = mixed[0]["exp_avg"].clone()  # on the GPU, as a scatter under NCCL hands it over
    mixed[0]["exp_avg"] = received
    mixed[1]["exp_avg"] = mixed[1]["exp_avg"].cpu()  # from the host, as a file gives it
    live = {(pid, k): v for pid, e in optim.state_dict()["state"].items() for k, v in e.items() if v.dim()}
    ready = optimizer_state_on_device(optim, {**saved, "state": mixed})
    assert ready["state"][0]["exp_avg"] is received, "a tensor received on its GPU becomes the state as it is"
    assert ready["state"][1]["exp_avg"] is live[(1, "exp_avg")], "a host tensor lands in the live one, on its GPU"
    optim.load_state_dict(ready)
    for pid, entries in want.items():
        for key, value in entries.items():
            assert torch.equal(optim.state_dict()["state"][pid][key], value), f"{pid}.{key}"
    kept = [(pid, k) for pid, k in live if (pid, k) != (0, "exp_avg")]
    assert all(optim.state_dict()["state"][pid][k] is live[(pid, k)] for pid, k in kept), "the other live tensors stay"


def _scatter_on_gpus(rank: int, world_size: int) -> dict[str, Any]:
    import _models as M
    from _checks import assert_identical

    import fsdp_optim

    model = M.wrap(M.make_net().cuda(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    for step in range(2):
        M.train_step(model, optim, *(t.cuda() for t in M.local_batch(step, rank, world_size)))
    full = model.gather_full_optim_state_dict(optim, recipient_rank=0)
    want = model.get_shard_from_optim_state_dict(
        model.gather_full_optim_state_dict(optim, recipient_rank=None), optim=optim
    )
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    fsdp_optim.scatter_full_optim_state(model, fresh, full if rank == 0 else None, src_rank=0)
    got = fresh.state_dict()
    assert_identical(
        {pid: {k: v.cpu() for k, v in e.items()} for pid, e in got["state"].items()},
        {pid: {k: v.cpu() for k, v in e.items()} for pid, e in want["state"].items()},
        f"rank {rank}: scattered state",
    )
    return {"devices": sorted({v.device.type for e in got["state"].values() for v in e.values() if v.dim()})}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: one NCCL rank per GPU")
def test_a_scatter_over_nccl_loads_each_rank_its_own_shard_on_its_gpu() -> None:
    from _dist import run_ranks

    assert run_ranks(_scatter_on_gpus, 2, backend="nccl") == [{"devices": ["cuda"]}] * 2
