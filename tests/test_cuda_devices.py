"""Which GPU a rank's object collectives use (fsdp_optim/job/gpu_choice.py): the group's bound device, else
``LOCAL_RANK``'s GPU, else the current one, with one warning where ``current_device()`` differs. On the CPU the
choice runs with a stated device count (``gpus``/``current`` passed, or ``torch.cuda``'s two answers replaced in a
rank of a real gloo group); beside it, CUDA tests on one GPU and on two."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _dist import run_ranks

from fsdp_optim.job import gpu_choice


def test_the_bound_device_wins_then_local_rank_then_the_current_device() -> None:
    bound = torch.device("cuda", 5)
    assert gpu_choice.choose(bound, "1", 8, 0) == bound, "init_process_group(device_id=...) decides"
    assert gpu_choice.choose(None, "3", 4, 0) == torch.device("cuda", 3), "torchrun's one GPU per local rank"
    assert gpu_choice.choose(None, "5", 4, 0) == torch.device("cuda", 1), "more local ranks than GPUs: wrapped"
    assert gpu_choice.choose(None, None, 4, 2) == torch.device("cuda", 2), "no LOCAL_RANK: the current device"


def test_a_choice_other_than_the_current_device_warns_once(monkeypatch) -> None:
    monkeypatch.setattr(gpu_choice, "_warned", [])
    monkeypatch.setenv("LOCAL_RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = gpu_choice.checked(None, gpus=2, current=0)
        again = gpu_choice.checked(None, gpus=2, current=0)
    said = [str(w.message) for w in caught]
    assert first == again == torch.device("cuda", 1), (first, again)
    assert said == [gpu_choice.mismatch(torch.device("cuda", 1), 0)], said
    assert "torch.cuda.set_device(1)" in said[0], said


def _object_device_of_a_group(rank: int, world_size: int) -> list[Any]:  # noqa: ARG001
    import os

    from fsdp_optim.job import transport

    torch.cuda.device_count = lambda: 2  # a machine with two GPUs, for the choice alone (no CUDA call follows)
    torch.cuda.current_device = lambda: 0  # a job that never called set_device
    os.environ["LOCAL_RANK"] = "1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = transport.object_device(None)
    return [str(chosen), [str(w.message)[:40] for w in caught]]


def test_the_transport_takes_its_object_device_from_local_rank_not_gpu_0() -> None:
    (result,) = run_ranks(_object_device_of_a_group, 1)
    assert result == ["cuda:1", ["checkpoint collectives use cuda:1 (the g"]], result


def _gather_without_set_device(rank: int, world_size: int) -> dict[str, Any]:
    import os

    from fsdp_optim.job import transport

    torch.cuda.set_device(0)  # as a job that never called set_device finds it on every rank
    os.environ["LOCAL_RANK"] = str(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = transport.all_gather_objects({"rank": rank}, None)
    return {"got": got, "device": str(transport.object_device(None)), "warned": bool(caught)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: an NCCL group of one rank")
def test_gpu_object_collectives_on_one_gpu_use_it_and_say_nothing() -> None:
    (result,) = run_ranks(_gather_without_set_device, 1, backend="nccl")
    assert result == {"got": [{"rank": 0}], "device": "cuda:0", "warned": False}, result


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: one NCCL rank per GPU")
def test_gpu_object_collectives_use_local_ranks_gpu_when_set_device_was_not_called() -> None:
    results = run_ranks(_gather_without_set_device, 2, backend="nccl")
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"], results
    assert [r["warned"] for r in results] == [False, True], "rank 1 is told that its current device is GPU 0"
