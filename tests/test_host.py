"""The host-execution switch: fairscale's OWN FullyShardedDataParallel trains on CPU/gloo inside
``fsdp_optim.host_execution()``, and leaving the switch gives fairscale's module back exactly as it was.

Everything runs in fresh spawned ranks: constructing ``fsdp_optim.FullyShardedDataParallel`` enables host
execution for the rest of its process, so the test process itself must not be the one checked.
"""

from __future__ import annotations

import os

import _models as M
import pytest
import torch
from _checks import assert_full_matches_plain, assert_identical, assert_unchanged, snapshot
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.job import host as _host

STEPS = 3
REL = 1e-5


def _skip_unused(name: str) -> bool:
    # A flat parameter gives a parameter that forward never uses a zero gradient, hence state.
    return name.startswith("unused.")


def _fairscale_state() -> dict[str, object]:
    """Every fairscale name the switch may replace, and whether record_stream has a CPU kernel."""
    import fairscale.internal.reduce_scatter_bucketer as bucketer
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fairscale_fsdp

    cls = fairscale_fsdp.FullyShardedDataParallel
    return {
        "torch": fairscale_fsdp.torch,
        "_get_default_cuda_device": fairscale_fsdp._get_default_cuda_device,
        "enable_nccl_base_collectives": bucketer.enable_nccl_base_collectives,
        **{name: cls.__dict__[name] for name in ("_setup_streams", "_init_param_attributes", "clip_grad_norm_")},
        "record_stream on CPU": torch._C._dispatch_has_kernel_for_dispatch_key("aten::record_stream", "CPU"),
    }


def _assert_restored(original: dict[str, object], where: str) -> None:
    now = _fairscale_state()
    for name, value in original.items():
        assert now[name] is value, f"{where}: {name} is {now[name]!r}, expected {value!r}"
    assert not _host.is_enabled(), where


def _wrap_with_fairscale(net: M.Net) -> torch.nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    cpu = torch.device("cpu")
    for path in M.NESTINGS["deep"]:
        parent_path, _, name = path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        setattr(parent, name, FairscaleFSDP(getattr(parent, name), compute_device=cpu))
    return FairscaleFSDP(net, compute_device=cpu)


def _fairscale_class_inside_the_switch(rank: int, world_size: int, out: str) -> dict:
    import torch.nn.functional as F
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    original = _fairscale_state()
    assert original["torch"] is torch and original["enable_nccl_base_collectives"] is True
    assert not _host.is_enabled()

    with fsdp_optim.host_execution():
        assert _host.is_enabled()
        with fsdp_optim.host_execution():  # nests
            fsdp_optim.enable_host_execution()
            fsdp_optim.disable_host_execution()
        assert _host.is_enabled(), "an inner exit must not switch off the outer block"
        assert FairscaleFSDP(torch.nn.Linear(2, 2)).compute_device == torch.device("cpu")  # the default

        root = _wrap_with_fairscale(M.make_net())
        assert type(root) is FairscaleFSDP
        optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
        norms = []
        for step in range(STEPS):
            tokens, targets = M.local_batch(step, rank, world_size)
            optim.zero_grad()
            F.cross_entropy(root(tokens).reshape(-1, M.VOCAB), targets.reshape(-1)).backward()
            norms.append(float(root.clip_grad_norm_(1e9)))  # the total norm over every rank's shard
            optim.step()

        model_state = root.state_dict()
        local = {k: v.clone() for k, v in root.local_state_dict().items()}
        root.load_local_state_dict(local)
        assert_identical(dict(root.local_state_dict()), local, "local_state_dict after load_local_state_dict")

        before = snapshot(optim.state_dict())
        directory = os.path.join(out, "fairscale-class")
        fsdp_optim.save_sharded_optim_state(root, optim, directory)
        loaded = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
        fsdp_optim.load_sharded_optim_state(root, loaded, directory)
        assert_identical(loaded.state_dict(), before, "saved then loaded")
        assert_unchanged(before, optim)
        M.train_step(root, loaded, *M.local_batch(STEPS, rank, world_size))  # the loaded state trains on

    _assert_restored(original, "after the with block")
    with pytest.raises(RuntimeError, match="without a matching enable_host_execution"):
        fsdp_optim.disable_host_execution()

    # The pair of functions, reference-counted.
    fsdp_optim.enable_host_execution()
    fsdp_optim.enable_host_execution()
    fsdp_optim.disable_host_execution()
    assert _host.is_enabled() and _fairscale_state()["torch"] is not torch
    fsdp_optim.disable_host_execution()
    _assert_restored(original, "after enable/enable/disable/disable")

    # Our subclass enables host execution for the rest of the process: a user's block no longer restores.
    M.wrap(M.make_net(), "shallow")
    with fsdp_optim.host_execution():
        pass
    assert _host.is_enabled(), "fsdp_optim.FullyShardedDataParallel still needs host execution"
    return {"model": model_state, "norms": norms} if rank == 0 else {"norms": norms}


def test_fairscale_class_trains_inside_the_switch_and_fairscale_is_restored_after(tmp_path) -> None:
    results = run_ranks(_fairscale_class_inside_the_switch, 2, str(tmp_path))
    assert results[0]["norms"] == results[1]["norms"]

    net, plain = M.train_plain("adam", range(STEPS))
    for key, value in net.state_dict().items():
        if not _skip_unused(key):
            atol = REL * float(value.abs().max())
            got = results[0]["model"][key]
            torch.testing.assert_close(got, value, rtol=REL, atol=atol, msg=lambda m: f"{key}: {m}")
    # Offline, with no process group: the checkpoint written by fairscale's own class is the plain state.
    full = fsdp_optim.consolidate(tmp_path / "fairscale-class")
    assert_full_matches_plain(full, plain.state_dict(), skip=_skip_unused, rel=REL)

    # clip_grad_norm_ returned the norm of the whole gradient (unused params in a flat unit add zeros).
    ref = M.make_net()
    ref_optim = M.OPTIMIZERS["adam"](M.plain_param_groups(ref))
    for step, norm in enumerate(results[0]["norms"]):
        tokens, targets = M.batch(step)
        ref_optim.zero_grad()
        torch.nn.functional.cross_entropy(ref(tokens).reshape(-1, M.VOCAB), targets.reshape(-1)).backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
        assert abs(norm - want) <= 1e-5 * want, (step, norm, want)
        ref_optim.step()


def test_the_cpu_path_is_chosen_where_fairscale_computes() -> None:
    """computes_on_host follows fairscale's compute_device (its default is the GPU): CPU offload computes on the GPU
    of a GPU machine (the old rule, by the parameters' device, took the CPU path there and then refused every GPU
    instance of the process); CPU parameters without offload take the CPU path on any machine."""
    from fsdp_optim.job.fsdp import ComputePlacement, computes_on_host, placement

    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def host(gpu: bool, compute: torch.device | None, offload: bool, devices: set[str]) -> bool:
        return computes_on_host(ComputePlacement(gpu, compute, offload, frozenset(devices)))

    for gpu in (False, True):
        assert host(gpu, cpu, False, {"cpu"}) and host(gpu, cpu, True, {"cpu"}), "an explicit CPU decides"
        assert not host(gpu, cuda, True, {"cpu"}), "an explicit GPU decides"
        assert host(gpu, None, False, {"cpu"}), "CPU parameters without offload: the CPU, on any machine"
        assert not host(gpu, None, False, {"cuda"}) and not host(gpu, None, False, {"meta"}), "params elsewhere"
        assert host(gpu, None, False, set()) is (not gpu), "no parameter at all: fairscale's default"
    assert not host(True, None, True, {"cpu"}), "CPU offload on a GPU machine computes on its GPU, as in fairscale"
    assert host(False, None, True, {"cpu"}), "CPU offload without CUDA: the CPU"

    cpu_net = torch.nn.Linear(2, 2)
    found = placement(cpu_net, {"cpu_offload": True, "compute_device": "cuda:0"})  # cpu_offload: the old name
    assert found == ComputePlacement(torch.cuda.is_available(), torch.device("cuda:0"), True, frozenset({"cpu"})), found
    assert placement(cpu_net, {}).offload is False, "no offload unless asked"
    meta_net = torch.nn.Linear(2, 2, device="meta")
    for p in meta_net.parameters():  # a root over wrapped units: every parameter already taken by a nested instance
        p._is_sharded = True  # type: ignore[attr-defined]  # fairscale's mark on the parameters it took over
    assert placement(meta_net, {}).param_devices == {"meta"}, "a root over units: their parameters' devices"


def _cpu_then_gpu_instance(rank: int, world_size: int) -> str:  # noqa: ARG001
    from fsdp_optim import FullyShardedDataParallel as FSDP

    FSDP(torch.nn.Linear(2, 2))  # computes on the CPU: host execution for the rest of this process
    assert _host.is_enabled()
    try:
        _host.note_cuda_root()  # what constructing an instance that computes on a GPU does first
    except RuntimeError as exc:
        return str(exc)
    return "not refused"


def _gpu_instance_then_switch(rank: int, world_size: int) -> str:  # noqa: ARG001
    _host.note_cuda_root()
    try:
        fsdp_optim.enable_host_execution()
    except RuntimeError as exc:
        return str(exc)
    return "not refused"


def test_cpu_and_gpu_instances_cannot_share_a_process_and_say_so() -> None:
    """The switch is process-wide: a GPU instance after a CPU one, or the switch after a GPU instance, is refused
    with a message saying why (in fresh ranks: the switch outlives the call)."""
    after_cpu = run_ranks(_cpu_then_gpu_instance, 1)[0]
    assert "runs fairscale's FSDP on the CPU" in after_cpu and "separate processes" in after_cpu, after_cpu
    after_gpu = run_ranks(_gpu_instance_then_switch, 1)[0]
    assert "compute on a GPU" in after_gpu and "separate processes" in after_gpu, after_gpu
