"""The FSDP constructor options users set, each with the optimizer-state features, on the CPU host.

One spawn at world size 2 (real gloo, real fairscale FSDP) runs every option that works: a few Adam
steps, then gather -> get_shard is exactly the live shard, get_shard loads into a fresh optimizer
exactly, save -> load is exactly the live state, the optimizer is never modified, the model's
``state_dict()`` / ``local_state_dict()`` / ``load_local_state_dict()`` work, and the loaded optimizer
trains on. Here the gathered dict and the model state are compared with unwrapped training. Options
that cannot work are refused at construction, before any collective, so those run in this process.

The model is ``_models.Net`` without its never-used parameter (with ``flatten_parameters=False``
fairscale's ``state_dict()`` cannot run with one; README "Known limits") and with a buffer, so that
``buffer_dtype`` has something to cast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_full_matches_plain, assert_identical, assert_unchanged, snapshot
from _dist import run_ranks

from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim import load_sharded_optim_state, save_sharded_optim_state

STEPS = 3
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Case:
    fsdp: dict[str, Any] = field(default_factory=dict)  # constructor options
    flatten: bool = True
    half: bool = False  # the module in float16: pure fp16 (compute_dtype=float16 without mixed_precision)
    rel: float = 1e-5  # tolerance against unwrapped training of the same module


CASES: dict[str, Case] = {
    "mixed_precision": Case({"mixed_precision": True}, rel=1e-2),
    "fp32_reduce_scatter": Case({"mixed_precision": True, "fp32_reduce_scatter": True}, rel=1e-2),
    "move_grads_to_cpu": Case({"move_grads_to_cpu": True}),
    # gradients follow (move_grads_to_cpu=None). Offload computes on the GPU of a GPU machine, as in fairscale:
    # these cases name the CPU, so that they test the CPU path there too (tests/test_cuda_offload.py: the GPU's).
    "move_params_to_cpu": Case({"move_params_to_cpu": True, "compute_device": CPU}),
    # cpu_offload (the old name of move_params_to_cpu) together with mixed precision and unflattened units.
    "cpu_offload": Case({"cpu_offload": True, "mixed_precision": True, "compute_device": CPU}, flatten=False, rel=1e-2),
    "reshard_after_forward": Case({"reshard_after_forward": False}),
    "flatten_parameters": Case(flatten=False),
    "no_broadcast_optim_state": Case({"no_broadcast_optim_state": True}),  # only fairscale's gather reads it
    # bf16 gradients: the weights differ by up to ~5e-2 of their scale from fp32 training.
    "compute_dtype": Case({"mixed_precision": True, "compute_dtype": torch.bfloat16}, rel=1e-1),
    "compute_dtype_pure_fp16": Case({"compute_dtype": torch.float16}, half=True, rel=2e-2),
    "buffer_dtype": Case({"buffer_dtype": torch.float64}),
    "state_dict_device": Case({"state_dict_device": torch.device("cpu")}),
}


def _net(half: bool = False) -> M.Net:
    net = M.make_net()
    del net.unused
    net.block1.register_buffer("scale", torch.ones(M.DIM))  # forward never reads it
    return net.half() if half else net


def _adam(case: Case, groups: Any) -> torch.optim.Optimizer:
    # fp16 state cannot hold Adam's default eps (1e-8 underflows to 0, and 0/0 gives NaN).
    return torch.optim.Adam(groups, lr=0.01, eps=1e-4 if case.half else 1e-8)


def _run_case(rank: int, world_size: int, name: str, case: Case, out: str) -> dict[str, Any]:
    root = M.wrap(_net(case.half), "deep", flatten=case.flatten, **case.fsdp)
    optim = _adam(case, M.fsdp_param_groups(root))
    for step in range(STEPS):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    before = snapshot(optim.state_dict())
    assert before["state"], "no optimizer state after training"

    full = root.gather_full_optim_state_dict(optim, recipient_rank=None)
    assert_identical(root.get_shard_from_optim_state_dict(full, optim=optim), before, "get_shard(gather)")
    fresh = _adam(case, M.fsdp_param_groups(root))
    fresh.load_state_dict(root.get_shard_from_optim_state_dict(full, optim=fresh))
    assert_identical(fresh.state_dict(), before, "gather -> get_shard -> load_state_dict")

    directory = os.path.join(out, name)
    save_sharded_optim_state(root, optim, directory)
    loaded = _adam(case, M.fsdp_param_groups(root))
    load_sharded_optim_state(root, loaded, directory)
    assert_identical(loaded.state_dict(), before, "save -> load")
    assert_unchanged(before, optim)

    model_state = root.state_dict()
    local = {key: value.clone() for key, value in root.local_state_dict().items()}
    root.load_local_state_dict(local)
    assert_identical(dict(root.local_state_dict()), local, "local_state_dict after load_local_state_dict")
    M.train_step(root, loaded, *M.local_batch(STEPS, rank, world_size))  # the loaded state trains on
    return {"full": full, "model": model_state}


def _run_cases(rank: int, world_size: int, names: list[str], out: str) -> dict[str, Any]:
    results = {}
    for name in names:
        try:
            results[name] = _run_case(rank, world_size, name, CASES[name], out)
        except Exception as exc:
            raise AssertionError(f"option {name}: {exc}") from exc
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(_run_cases, 2, list(CASES), str(tmp_path_factory.mktemp("options")))[0]


@pytest.mark.parametrize("option", list(CASES))
def test_option_works_with_gather_get_shard_save_and_load(results, option: str) -> None:
    """The round trips ran in the ranks; here the state they moved matches unwrapped training."""
    case = CASES[option]
    net = _net(case.half)
    plain = _adam(case, M.plain_param_groups(net))
    M.train_plain("adam", range(STEPS), net=net, optim=plain)

    full, model = results[option]["full"], results[option]["model"]
    assert_full_matches_plain(full, plain.state_dict(), rel=case.rel)
    for key, value in net.state_dict().items():
        got = model[key]
        assert got.device == torch.device("cpu"), (key, got.device)
        if option == "buffer_dtype" and key == "block1.scale":
            assert got.dtype == torch.float64, got.dtype  # buffers stay in buffer_dtype
            got = got.to(value.dtype)
        assert got.dtype == value.dtype, (key, got.dtype, value.dtype)  # full precision, as fairscale promises
        atol = case.rel * float(value.float().abs().max())
        torch.testing.assert_close(got, value, rtol=case.rel, atol=atol, msg=lambda m: f"{option} {key}: {m}")


BF16 = r"compute_dtype=torch.bfloat16 differs .* mixed_precision=True"
CUDA = torch.device("cuda")
REFUSED = {
    "compute_dtype": ({"compute_dtype": torch.bfloat16}, BF16),
    "compute_dtype with offload": ({"compute_dtype": torch.bfloat16, "move_params_to_cpu": True}, BF16),
    "state_dict_device": ({"state_dict_device": CUDA}, r"state_dict_device=device\(type='cuda'\): .*no CUDA"),
    "compute_device": ({"compute_device": "cuda:0"}, r"compute_device='cuda:0': .*no CUDA"),
}


@pytest.mark.parametrize("option", list(REFUSED))
def test_option_is_refused_at_construction_naming_it(option: str) -> None:
    options, match = REFUSED[option]
    if "device" in option and torch.cuda.is_available():
        pytest.skip("a CUDA device is a valid choice here")
    with pytest.raises(ValueError, match=match):
        FSDP(_net(), **options)  # refused before any collective: this process has no process group


def _bf16_forward(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    net[2] = FSDP(net[2], mixed_precision=True, compute_dtype=torch.bfloat16)
    root = FSDP(net, mixed_precision=True, compute_dtype=torch.bfloat16)
    optim = torch.optim.Adam(root.parameters(), lr=0.01)
    before = [p.detach().clone() for p in root.parameters()]
    x = torch.randn(4, 8)
    with pytest.raises(ValueError) as caught:
        root(x)  # fairscale would cast it to float16 and fail on "Half and BFloat16"
    assert all(torch.equal(a, b) for a, b in zip(before, root.parameters())), "a refused forward changed nothing"
    for run in (lambda: root(x.to(torch.bfloat16)), lambda: _under_autocast(root, x)):  # the two ways that work
        optim.zero_grad()
        run().float().sum().backward()
        optim.step()
    assert all(p.dtype == torch.float32 for p in root.parameters()), "fp32 master weights"
    return str(caught.value)


def _under_autocast(root: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return root(x)


def test_bf16_mixed_precision_refuses_float32_inputs_by_name() -> None:
    """mixed_precision=True, compute_dtype=bfloat16 builds (token ids, bf16 inputs and autocast work: the
    "compute_dtype" case above trains with it), but a float32 input is refused at the forward, naming it."""
    message = run_ranks(_bf16_forward, 2)[0]
    assert "input args[0] is float32" in message and "casts float32 inputs to float16" in message, message
    assert "torch.autocast" in message, message
