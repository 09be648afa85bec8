"""Format-3 checkpoints written by 679b6f9 still read on this code: the committed fixtures
``tests/fixtures/v3_adam_w2`` (optimizer only) and ``v3_whole_w2`` (weights, a buffer, optimizer, extra), made by
``tests/fixtures/make_fixture.py`` on that commit, verify as intact, consolidate to exactly what that commit's
``consolidate`` returned, reshard to 3 ranks and back unchanged, and load into real jobs (W = 2; W = 3 for the whole
one) with the values saved."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical, loads_old_fixture_exactly
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.cli import main as cli

FIXTURES = Path(__file__).parent / "fixtures"
V3 = ("v3_adam_w2", "v3_whole_w2")


def _expected(fixture: Path, name: str) -> Any:
    return torch.load(fixture / name, weights_only=True)


def _as_if_at_w2(optim_full: dict[str, Any], world_size: int) -> dict[str, Any]:
    """``optim_full`` with its one field recording the world size it came from (checked) set to the saved 2."""
    assert optim_full["fsdp_optim"]["world_size"] == world_size, f"expected W={world_size}: {optim_full['fsdp_optim']}"
    return {**optim_full, "fsdp_optim": {**optim_full["fsdp_optim"], "world_size": 2}}


@pytest.fixture(params=V3)
def copied(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The fixture copied into ``tmp_path``: nothing below writes near the committed one."""
    return Path(shutil.copytree(FIXTURES / request.param, tmp_path / request.param))


def test_v3_fixtures_verify_intact(copied: Path, capsys: pytest.CaptureFixture) -> None:
    for deep in (False, True):
        found = fsdp_optim.verify(copied / "ckpt", deep=deep)
        assert found.ok, f"{copied.name} (deep={deep}): {found.lines()}"
    assert cli(["verify", str(copied / "ckpt")]) == 0, f"{copied.name}: {capsys.readouterr()}"
    assert cli(["inspect", str(copied / "ckpt")]) == 0, f"{copied.name}: inspect failed"
    assert "(version 3)" in capsys.readouterr().out, f"{copied.name}: not reported as format 3"


def test_v3_fixtures_consolidate_and_reshard_exactly(copied: Path) -> None:
    expected = _expected(copied, "consolidated.pt")
    assert_identical(fsdp_optim.consolidate(copied / "ckpt"), expected, f"{copied.name} consolidated")
    fsdp_optim.reshard(copied / "ckpt", 3, copied / "ws3")
    fsdp_optim.reshard(copied / "ws3", 2, copied / "ws2")
    for resharded, world_size in (("ws3", 3), ("ws2", 2)):
        assert fsdp_optim.verify(copied / resharded).ok, f"{copied.name} {resharded}: not intact"
        full = fsdp_optim.consolidate(copied / resharded)
        if "optimizer" in full:
            full = {**full, "optimizer": _as_if_at_w2(full["optimizer"], world_size)}
        else:
            full = _as_if_at_w2(full, world_size)
        assert_identical(full, expected, f"{copied.name} {resharded}")



def test_v3_optim_fixture_loads_exactly_in_a_job(tmp_path: Path) -> None:
    fixture = shutil.copytree(FIXTURES / "v3_adam_w2", tmp_path / "v3_adam_w2")
    assert all(run_ranks(loads_old_fixture_exactly, 2, str(fixture))), "a rank failed to load the format-3 fixture"


def _load_whole(rank: int, world_size: int, fixture: str) -> bool:
    net = M.make_net(seed=123)  # another init: the load must win
    net.block1.register_buffer("seen", torch.zeros(4))  # as the saved model had it (make_fixture.whole_job)
    root = M.wrap(net, "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    extra = fsdp_optim.load_checkpoint(root, optim, os.path.join(fixture, "ckpt"))
    assert_identical(extra, torch.load(os.path.join(fixture, f"extra{rank % 2}.pt")), "extra")
    assert_identical(root.state_dict(), torch.load(os.path.join(fixture, "model.pt")), "model")
    full = root.gather_full_optim_state_dict(optim)
    if rank == 0:
        expected = torch.load(os.path.join(fixture, "consolidated.pt"), weights_only=True)["optimizer"]
        assert_identical(_as_if_at_w2(full, world_size), expected, f"optimizer at W={world_size}")
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_v3_whole_fixture_loads_exactly_in_a_job(tmp_path: Path, world_size: int) -> None:
    fixture = shutil.copytree(FIXTURES / "v3_whole_w2", tmp_path / "v3_whole_w2")
    assert all(run_ranks(_load_whole, world_size, str(fixture))), f"a rank failed to load at W={world_size}"
