"""The gather's object transport carries host tensors: parts pickled from several GPUs used to arrive on each
sender's device (``cuda:r``) and ``torch.cat`` across devices raised on the recipient (2+ GPUs under NCCL).

Here "meta" stands in for a second device (this machine has only the CPU): the mapping is the same for any device.
The CUDA tests run the real transport: on one GPU (gloo, one rank's state moved to the GPU after training on the CPU)
and on two GPUs under NCCL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_optim.job.skeleton import moved


def test_parts_from_several_devices_are_put_on_one_before_they_are_joined() -> None:
    """What a recipient held before: parts on two devices, which torch.cat refuses; moved() puts every tensor of a
    received object on one device, keeps its structure, and leaves tensors already there as they are."""
    parts = [torch.arange(3.0), torch.ones(2, device="meta")]
    with pytest.raises(RuntimeError, match="device"):
        torch.cat(parts)
    received = {"summary": ("Adam", 3), "shards": {(0, "exp_avg"): parts[0], (1, "exp_avg"): parts[1]}, "n": [parts]}
    on_meta = moved(received, torch.device("meta"))
    assert on_meta["summary"] == ("Adam", 3), "values that are not tensors travel as they are"
    shards = on_meta["shards"]
    assert {t.device.type for t in shards.values()} == {"meta"}, shards
    assert torch.cat(list(shards.values())).shape == (5,), "joined on one device"
    assert shards[(1, "exp_avg")] is parts[1], "a tensor already there is not copied"
    assert isinstance(on_meta["n"], list) and isinstance(on_meta["n"][0], list), "structure kept"
    on_host = moved({"x": parts[0]}, torch.device("cpu"))
    assert on_host["x"] is parts[0], "a host tensor sent as it is"


def _gather_both(rank: int, world_size: int) -> dict[str, Any] | None:
    import _models as M
    from _checks import assert_identical

    model = M.wrap(M.make_net().cuda(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    for step in range(2):
        M.train_step(model, optim, *(t.cuda() for t in M.local_batch(step, rank, world_size)))
    by_tensor = model.gather_full_optim_state_dict(optim, recipient_rank=0)
    by_object = model.gather_full_optim_state_dict(optim, recipient_rank=0, transport="object")
    if rank != 0:
        return None
    assert_identical(by_object, by_tensor, "object vs tensor transport on GPUs")
    return {"devices": sorted({v.device.type for s in by_object["state"].values() for v in s.values() if torch.is_tensor(v)})}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: one NCCL rank per GPU")
def test_the_object_transport_gathers_from_two_gpus() -> None:
    from _dist import run_ranks

    found = run_ranks(_gather_both, 2, backend="nccl")[0]
    assert found == {"devices": ["cpu"]}, found


def _one_rank_on_the_gpu(rank: int, world_size: int) -> str:
    import _models as M
    from _checks import assert_identical

    model = M.wrap(M.make_net(), "deep")  # trained on the CPU (gloo)
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    for step in range(2):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    want = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    if rank == 1:  # its shards on the GPU, rank 0's on the host: parts from two devices meet on every rank
        for entries in optim.state.values():
            entries.update({k: v.cuda() for k, v in entries.items() if torch.is_tensor(v) and v.dim()})
    got = model.gather_full_optim_state_dict(optim, recipient_rank=None, transport="object")
    assert_identical(got, want, f"rank {rank}: object transport with shards on the GPU and the host")
    return "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: one rank's shards on it")
def test_the_object_transport_gathers_shards_from_the_gpu_and_the_host(monkeypatch) -> None:
    from _dist import run_ranks

    monkeypatch.setenv("FSDP_OPTIM_TEST_SPAWN", "1")  # fresh ranks that start CUDA themselves, not forks
    assert run_ranks(_one_rank_on_the_gpu, 2) == ["ok", "ok"]
