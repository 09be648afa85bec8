"""A plain (non-FSDP) optimizer's ``state_dict()``, named with ``name_optimizer_state`` (or ``--param-names`` on
the command line), loads into FSDP at 2 ranks as a gathered full dict would."""

from __future__ import annotations

import json
import os
from pathlib import Path

import _models as M
import pytest
import torch
import torch.nn.functional as F
from _checks import assert_full_matches_plain
from _dist import run_ranks

from fsdp_optim import name_optimizer_state
from fsdp_optim.cli import main

STEPS = range(3)


def _plain(groups: str) -> tuple[M.Net, torch.optim.Optimizer]:
    """Adam over the unwrapped model; ``unused`` gets zero gradients, as its part of an FSDP flat does (a unit
    whose parameters have state for some only is refused by the planner)."""
    net = M.make_net()
    params = M.plain_param_groups(net) if groups == "two" else net.parameters()
    optim = torch.optim.Adam(params, lr=0.01)
    for step in STEPS:
        optim.zero_grad()
        tokens, targets = M.batch(step)
        F.cross_entropy(net(tokens).reshape(-1, M.VOCAB), targets.reshape(-1)).backward()
        for p in net.unused.parameters():
            p.grad = torch.zeros_like(p)
        optim.step()
    return net, optim


def _load(rank: int, world_size: int, full: dict, path: str, groups: str) -> list[dict]:
    from fsdp_optim import gather_full_optim_state_dict, get_shard_from_optim_state_dict, scatter_full_optim_state

    gathered = []
    for how in ("get_shard", "scatter"):
        root = M.wrap(M.make_net(), "deep")
        params = M.fsdp_param_groups(root) if groups == "two" else root.parameters()
        optim = torch.optim.Adam(params, lr=0.01)
        if how == "get_shard":
            optim.load_state_dict(get_shard_from_optim_state_dict(root, full, optim=optim))
        else:
            scatter_full_optim_state(root, optim, path if rank == 0 else None)
        gathered.append(gather_full_optim_state_dict(root, optim))
    return gathered


@pytest.mark.parametrize("groups", ["one", "two"])
def test_named_plain_state_loads_into_fsdp_at_two_ranks(tmp_path: Path, groups: str) -> None:
    net, optim = _plain(groups)
    plain = optim.state_dict()
    full = name_optimizer_state(plain, net, optimizer=optim if groups == "two" else None)
    assert "param_names" not in plain, "the caller's dict is left as it was"
    assert full["param_names"] == M.plain_param_names(net) if groups == "two" else True, full["param_names"]
    torch.save(full, tmp_path / "full.pt")
    for gathered in run_ranks(_load, 2, full, str(tmp_path / "full.pt"), groups)[0]:
        assert_full_matches_plain(gathered, full)


def test_mismatches_are_refused_clearly() -> None:
    net, optim = _plain("two")
    plain = optim.state_dict()
    with pytest.raises(ValueError, match=r"id \d+ \(.*\): state 'exp_avg' has shape .* expected the parameter's"):
        name_optimizer_state(plain, net)  # two groups not in named_parameters() order, and no optimizer=
    with pytest.raises(ValueError, match="its param groups hold 18 parameter ids .* the model has 6 parameters"):
        name_optimizer_state(plain, M.make_net().block2)
    with pytest.raises(ValueError, match="already names its parameters"):
        name_optimizer_state(name_optimizer_state(plain, net, optimizer=optim), net)
    with pytest.raises(ValueError, match="FSDP-wrapped module"):
        name_optimizer_state(plain, _FlatLike())


class _FlatLike(torch.nn.Module):
    """What fairscale's FSDP shows as named_parameters() (a flat parameter), without a process group."""

    def __init__(self) -> None:
        super().__init__()
        self.flat_param_0 = torch.nn.Parameter(torch.zeros(3))


def test_cli_names_a_plain_dict(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    net, optim = _plain("one")
    torch.save(optim.state_dict(), tmp_path / "plain.pt")
    code = main(["convert", str(tmp_path / "plain.pt"), "-o", str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert code == 1 and "name_optimizer_state" in err and "--param-names FILE" in err, err
    shapes = {n: list(p.shape) for n, p in net.named_parameters()}
    (tmp_path / "names.json").write_text(json.dumps(shapes))
    argv = ["convert", str(tmp_path / "plain.pt"), "-o", str(tmp_path / "out.pt"), "--param-names"]
    assert main([*argv, str(tmp_path / "names.json")]) == 0, capsys.readouterr().err
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_full_matches_plain(out, name_optimizer_state(optim.state_dict(), net))
    (tmp_path / "wrong.json").write_text(json.dumps(dict(reversed(shapes.items()))))
    assert main([*argv, str(tmp_path / "wrong.json")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'plain.pt'}: does not fit the model's parameters" in err, err
    assert not os.path.exists(tmp_path / "out2.pt")
