"""Formats in the wild, with real process groups: fairscale's own full dicts, and moving to PyTorch FSDP2.

One job at world size 2:

1. fairscale-native: a model trained under fairscale FSDP (one param group, as fairscale requires) is
   gathered twice, by our ``gather_full_optim_state_dict`` and by fairscale's own; converting
   fairscale's dict with the model's layout gives ours.
2. FSDP2: a model trained under fairscale is exported with ``to_named``, written to a file, and a model
   wrapped with ``torch.distributed.fsdp.fully_shard`` (FSDP2, CPU/gloo) loads it through
   ``set_optimizer_state_dict`` and keeps training: the result matches uninterrupted unwrapped training.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import _models as M
import pytest
import torch
from _checks import assert_fsdp2_matches_plain, assert_identical
from _dist import run_ranks

from fsdp_optim import from_fairscale, save_layout, to_named
from fsdp_optim.offline.layouts import resolve_layout

SAVE_AT, TOTAL = 2, 4
REL = 1e-4


def _skip_unused(name: str) -> bool:
    return name.startswith("unused.")  # see README "Known limits": flat parameters give it state


def _fairscale_native(rank: int, world_size: int, out: str) -> dict:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    results = {}
    for name in ("sgd_momentum", "adagrad"):
        root = M.wrap(M.make_net(), "deep")
        optim = M.OPTIMIZERS[name](root.parameters())  # fairscale: one param group over root.parameters()
        for step in range(SAVE_AT):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        ours = root.gather_full_optim_state_dict(optim)  # first: fairscale's turns the live `step` into a float
        native = FairscaleFSDP.gather_full_optim_state_dict(root, optim)
        if rank == 0:
            save_layout(root, os.path.join(out, "layout.pt"))
            torch.save(native, os.path.join(out, f"{name}.fairscale.pt"))
            results[name] = ours
    return results


def _export_then_fsdp2(rank: int, world_size: int, out: str) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Train under fairscale, export by parameter name.
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(SAVE_AT):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    full = root.gather_full_optim_state_dict(optim)
    model_state = root.state_dict()
    if rank == 0:
        torch.save(to_named(full), os.path.join(out, "named.pt"))
        torch.save(model_state, os.path.join(out, "model.pt"))
    dist.barrier()

    # Continue under FSDP2.
    mesh = init_device_mesh("cpu", (world_size,))
    net = M.make_net(seed=123)
    for unit in M.NESTINGS["deep"]:
        fully_shard(net.get_submodule(unit), mesh=mesh)
    fully_shard(net, mesh=mesh)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(net, torch.load(os.path.join(out, "model.pt"), weights_only=True), options=options)
    optim2 = M.OPTIMIZERS["adam"](M.plain_param_groups(net))
    named = torch.load(os.path.join(out, "named.pt"), weights_only=True)
    set_optimizer_state_dict(net, optim2, named, options=StateDictOptions(full_state_dict=True, strict=False))
    for step in range(SAVE_AT, TOTAL):
        M.train_step(net, optim2, *M.local_batch(step, rank, world_size))
    final_model = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    final_optim = get_optimizer_state_dict(net, optim2, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": final_model, "optim": final_optim} if rank == 0 else {}


def _both(rank: int, world_size: int, out: str) -> dict:
    return {"native": _fairscale_native(rank, world_size, out), "fsdp2": _export_then_fsdp2(rank, world_size, out)}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("interop")
    return out, run_ranks(_both, 2, str(out))[0]


def test_fairscale_native_converts_to_our_format(job) -> None:
    out, results = job
    layout = resolve_layout(out / "layout.pt")
    native = torch.load(out / "sgd_momentum.fairscale.pt", weights_only=True)
    assert_identical(from_fairscale(native, layout, optimizer="SGD"), results["native"]["sgd_momentum"], "sgd")

    # Adagrad: fairscale turns `step` into a Python float, and copies unit 0's value to every parameter,
    # so the frozen unit (which Adagrad gave step 0 at construction) reads 2 there. Everything else is exact.
    ours = results["native"]["adagrad"]
    native = torch.load(out / "adagrad.fairscale.pt", weights_only=True)
    assert all(isinstance(entries["step"], float) for entries in native["state"].values())
    converted = from_fairscale(native, layout, optimizer="Adagrad")
    frozen = {pid for pid, name in ours["param_names"].items() if name.startswith("frozen.")}
    for pid in frozen:
        assert ours["state"][pid]["step"] == 0 and converted["state"][pid]["step"] == SAVE_AT
        converted["state"][pid]["step"] = ours["state"][pid]["step"].clone()
    assert_identical(converted, ours, "adagrad")


def test_fairscale_native_per_rank_scalars_become_one_value(job) -> None:
    """fairscale returns a 0-dim state other than ``step`` (NAdam's ``mu_product``) as a list, one value
    per rank, on the last parameter of each unit. (Its gather of such states cannot run on gloo, which
    refuses 0-dim inputs into 1-element buffers, so the list is added here as fairscale writes it.)"""
    out, results = job
    layout = resolve_layout(out / "layout.pt")
    native = torch.load(out / "sgd_momentum.fairscale.pt", weights_only=True)
    last_ids, gid = [], -1
    for flat in layout.flat_params:
        gid += len(flat.params)
        if gid in native["state"]:
            last_ids.append(gid)
    with_lists = {**native, "state": dict(native["state"])}
    for gid in last_ids:
        with_lists["state"][gid] = {**native["state"][gid], "mu_product": [torch.tensor(0.81), torch.tensor(0.81)]}
    converted = from_fairscale(with_lists, layout, optimizer="SGD")
    expected = results["native"]["sgd_momentum"]
    assert set(converted["state"]) == set(expected["state"])
    for pid, entries in converted["state"].items():
        assert list(entries) == ["momentum_buffer", "mu_product"], entries
        assert_identical(entries["mu_product"], torch.tensor(0.81), expected["param_names"][pid])
    assert converted["fsdp_optim"]["scalar_keys"] == ["mu_product"]
    with_lists["state"][last_ids[0]] = {**native["state"][last_ids[0]], "mu_product": [torch.tensor(0.81), torch.tensor(0.5)]}
    with pytest.raises(ValueError, match="per-rank state 'mu_product' of .* differs across ranks"):
        from_fairscale(with_lists, layout)
    assert "mu_product" not in native["state"][last_ids[0]]  # the input was never modified


def test_fairscale_native_refused_for_another_model(job) -> None:
    out, _ = job
    native = torch.load(out / "sgd_momentum.fairscale.pt", weights_only=True)
    layout = resolve_layout(out / "layout.pt")
    shallow = type(layout)(layout.flat_params[:-1], layout.param_order, layout.world_size, layout.rank)
    with pytest.raises(ValueError, match="but the layout has 16 in 4 FSDP units"):
        from_fairscale(native, shallow)
    bad = dict(native, uncollected_local_ids=[3])
    with pytest.raises(ValueError, match="uncollected local ids"):
        from_fairscale(bad, layout)
    with pytest.raises(ValueError, match="expected a fairscale-native dict"):
        from_fairscale({"state": {}}, layout)


def test_export_to_fsdp2_continues_training(job) -> None:
    _, results = job
    net, plain = M.train_plain("adam", range(TOTAL))
    final = results["fsdp2"]
    # FSDP2's full optimizer state is keyed by name; it is keyed by the plain optimizer's ids to compare.
    assert_fsdp2_matches_plain(final, net, plain, names=M.plain_param_names(net), skip=_skip_unused, rel=REL)


def test_to_named_checks_input_and_shares_tensors(job) -> None:
    _, results = job
    full = results["native"]["sgd_momentum"]
    named = to_named(full)
    assert set(named) == {"state", "param_groups"}
    pid, entries = next(iter(full["state"].items()))
    assert named["state"][full["param_names"][pid]]["momentum_buffer"] is entries["momentum_buffer"]
    with pytest.raises(ValueError, match="expected a full optimizer state dict with 'state', 'param_groups' and 'param_names'"):
        to_named({"state": {}, "param_groups": []})
