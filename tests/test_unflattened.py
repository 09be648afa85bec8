"""``flatten_parameters=False`` at every world size, one rank included.

At world size 1 fairscale neither flattens nor shards a parameter left unflattened (its ``_shard_parameters_`` keeps
the parameter's own shape), so the live shard of ``Linear(7, 13).weight`` is ``(13, 7)``, not ``(91,)``. A
flattened and an unflattened job of the same model train side by side through W = 1 -> 2 -> 3 -> 2 -> 1, each
phase loading the last phase's whole checkpoints and saving its own: every gathered state, every model state and
every offline consolidation of the unflattened job is bit for bit the flattened job's (training at W = 1 and 2 is
bit-exact between the two; at W = 3 a three-rank sum depends on how fairscale buckets it, so that phase only
loads, gathers and saves). At W = 1 the optimizer-only paths (save/load, full dict, scatter) load state that the
next real step uses, bit-exact against the job that never stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _checks import assert_identical
from _dist import run_ranks
from torch import nn

import fsdp_optim
from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim.core.flatten import classify_flat_state
from fsdp_optim.core.layout import FlatParamLayout, ParamSpec

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3
# (world size, phase whose checkpoints it loads, training steps): phases 2 and 4 load the other job's checkpoint.
PHASES = [(1, None, 2), (2, 0, 1), (3, 1, 0), (2, 2, 1), (1, 3, 1)]
CROSSED = {2, 4}
TAGS = {True: "flat", False: "unflat"}


class Small(nn.Module):
    """Odd sizes (every shard pads at W = 2 and 3), a nested unit in its own param group."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.block = nn.Sequential(nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 13))
        self.head = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.block(h))


def _job(flatten: bool, seed: int, device: str = "cpu") -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Small().to(device)
    net.block = FSDP(net.block, flatten_parameters=flatten)
    root = FSDP(net, flatten_parameters=flatten)
    block = list(root.module.block.parameters())
    rest = [p for p in root.parameters() if all(p is not q for q in block)]
    groups = [{"params": rest}, {"params": block, "lr": 0.02}]
    return root, torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _train(root: FSDP, optim: torch.optim.Optimizer, step: int, rank: int, world_size: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    per = GLOBAL_BATCH // world_size
    mine = slice(rank * per, (rank + 1) * per)
    device = next(root.parameters()).device
    optim.zero_grad()
    F.mse_loss(root(x[mine].to(device)), y[mine].to(device)).backward()
    optim.step()


def _gathered(root: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The full dict without its world-size record: what two jobs at different world sizes must share."""
    full = root.gather_full_optim_state_dict(optim)
    return None if full is None else {k: full[k] for k in ("state", "param_groups", "param_names")}


def _phase(rank: int, world_size: int, out: str, phase: int) -> dict[str, Any]:
    _, source, steps = PHASES[phase]
    first = sum(s for _, _, s in PHASES[:phase])
    results: dict[str, Any] = {}
    for flatten in (True, False):
        root, optim = _job(flatten, seed=0 if source is None else 123)  # another init: a load must win
        result: dict[str, Any] = {}
        if source is not None:
            loaded_from = TAGS[flatten != (phase in CROSSED)]
            fsdp_optim.load_checkpoint(root, optim, Path(out) / f"p{source}-{loaded_from}")
            result["loaded"] = (root.state_dict(), _gathered(root, optim))
        for step in range(first, first + steps):
            _train(root, optim, step, rank, world_size)
        fsdp_optim.save_checkpoint(root, optim, Path(out) / f"p{phase}-{TAGS[flatten]}", extra={"phase": phase})
        result["saved"] = (root.state_dict(), _gathered(root, optim))
        if flatten is False:  # fairscale keeps the parameter's own shape at W = 1 only
            shapes = {tuple(p.shape) for p in root.parameters()}
            assert ((13, 7) in shapes) == (world_size == 1), f"W={world_size}: live shapes {sorted(shapes)}"
        results[TAGS[flatten]] = result
    return results if rank == 0 else {}


def test_unflattened_matches_flattened_through_every_world_size(tmp_path: Path) -> None:
    saved: list[tuple[dict[str, Any], Any]] = []
    for phase, (world_size, source, _) in enumerate(PHASES):
        results = run_ranks(_phase, world_size, str(tmp_path), phase)[0]
        flat, unflat = results["flat"], results["unflat"]
        assert_identical(unflat["saved"], flat["saved"], f"phase {phase} (W={world_size}): saved, unflat vs flat")
        if source is not None:
            for tag in TAGS.values():
                assert_identical(results[tag]["loaded"], saved[source], f"phase {phase} (W={world_size}): {tag} loaded")
        for tag in TAGS.values():  # offline, no process group: the unflattened checkpoint reads like the flat one
            offline = fsdp_optim.consolidate(tmp_path / f"p{phase}-{tag}")
            model, optimizer = flat["saved"]
            assert_identical(offline["model"], model, f"phase {phase}: consolidated {tag} model")
            assert_identical({k: offline["optimizer"][k] for k in optimizer}, optimizer, f"phase {phase}: {tag}")
        saved.append(flat["saved"])


def _one_rank(rank: int, world_size: int, out: str) -> None:
    """At W = 1, unflattened: every other way in (optimizer-only save, full dict, scatter, an async whole save) loads
    state that the next step uses as the live job did."""
    root, optim = _job(False, seed=0)
    for step in range(2):
        _train(root, optim, step, rank, world_size)
    full = root.gather_full_optim_state_dict(optim)
    fsdp_optim.save_sharded_optim_state(root, optim, Path(out) / "optim")
    fsdp_optim.async_save_checkpoint(root, optim, Path(out) / "whole").wait()
    weights = {name: p.detach().clone() for name, p in root.named_parameters()}
    _train(root, optim, 2, rank, world_size)
    expected = (root.state_dict(), _gathered(root, optim))
    loads = {
        "async_save_checkpoint": lambda r, o: fsdp_optim.load_checkpoint(r, o, Path(out) / "whole"),
        "load_sharded_optim_state": lambda r, o: fsdp_optim.load_sharded_optim_state(r, o, Path(out) / "optim"),
        "get_shard_from_optim_state_dict": lambda r, o: o.load_state_dict(
            r.get_shard_from_optim_state_dict(full, optim=o)
        ),
        "scatter_full_optim_state": lambda r, o: fsdp_optim.scatter_full_optim_state(r, o, full),
    }
    for how, load in loads.items():
        again, fresh = _job(False, seed=123)
        with torch.no_grad():
            for name, p in again.named_parameters():
                p.copy_(weights[name])
        load(again, fresh)
        for param, state in fresh.state.items():
            for key, value in state.items():
                ok = value.dim() == 0 or value.shape == param.shape
                assert ok, f"{how}: '{key}' is {tuple(value.shape)}, its parameter {tuple(param.shape)}"
        _train(again, fresh, 2, rank, world_size)  # fails on state that is not in the parameter's shape
        assert_identical((again.state_dict(), _gathered(again, fresh)), expected, f"{how}, then one step")


def test_one_rank_optimizer_state_loads_in_the_parameters_shape(tmp_path: Path) -> None:
    run_ranks(_one_rank, 1, str(tmp_path))


def test_zero_dim_parameter_kept_unflattened_is_refused() -> None:
    """Its per-element state (``exp_avg``) would be 0-dim like ``step``: refused by name, never saved as a scalar.
    (Pure: fairscale 0.4.13 itself cannot run a forward over such a parameter, so no job reaches this.)"""
    layout = FlatParamLayout("", (ParamSpec("scale", (), 0),), 1, 0, torch.float32, flattened=False)
    state = {"step": torch.tensor(1.0), "exp_avg": torch.tensor(0.5)}
    with pytest.raises(NotImplementedError, match="0-dim parameter .* flatten_parameters=True"):
        classify_flat_state(layout, state)
    assert classify_flat_state(layout, {}) == {}, "a parameter without state is fine"


def _inside_summon(rank: int, world_size: int, out: str) -> str:
    root, optim = _job(False, seed=0)
    _train(root, optim, 0, rank, world_size)
    with root.summon_full_params(), pytest.raises(ValueError) as caught:
        fsdp_optim.save_checkpoint(root, optim, Path(out) / "never")
    return str(caught.value)


def test_parameter_out_of_its_sharded_state_is_named_with_its_shape(tmp_path: Path) -> None:
    """At W = 2 an unflattened parameter's shard is 1-D (ceil(91 / 2) = 46 elements); gathered, it is (13, 7)."""
    message = run_ranks(_inside_summon, 2, str(tmp_path))[0]
    assert "has shape (13, 7), expected this rank's shard of shape (46,)" in message, message
    assert not (tmp_path / "never").exists(), "a refused save writes nothing"


def _on_gpu(rank: int, world_size: int, out: str) -> None:
    """At W = 1 on a GPU (nccl): the whole checkpoint's weights and state go back in the parameters' own shape."""
    root, optim = _job(False, seed=0, device="cuda")
    for step in range(2):
        _train(root, optim, step, rank, world_size)
    fsdp_optim.save_checkpoint(root, optim, Path(out) / "gpu")
    _train(root, optim, 2, rank, world_size)
    again, fresh = _job(False, seed=123, device="cuda")
    fsdp_optim.load_checkpoint(again, fresh, Path(out) / "gpu")
    for param, state in fresh.state.items():
        shapes = {key: tuple(v.shape) for key, v in state.items() if v.dim()}
        assert all(s == tuple(param.shape) for s in shapes.values()), f"{shapes} for {tuple(param.shape)}"
    _train(again, fresh, 2, rank, world_size)
    assert_identical((again.state_dict(), _gathered(again, fresh)), (root.state_dict(), _gathered(root, optim)), "gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_unflattened_on_gpu(tmp_path: Path) -> None:
    run_ranks(_on_gpu, 1, str(tmp_path), backend="nccl")
