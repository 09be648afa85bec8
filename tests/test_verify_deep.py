"""``verify(path, deep=True)`` / ``fsdp-optim verify --deep``: what a resumed run would trip on in state whose
checksums match, each finding naming its parameter and state key (or param group and hyperparameter).

Offline, on real files: the committed format-2 checkpoint and its gathered full dict (``tests/fixtures/v2_adam_w2``)
and what ``reshard`` / ``to_safetensors`` make of them; each problem is injected through the full dict, saved, and
(where a sharded checkpoint can hold it) resharded, so that the checksums of every file match.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_optim
from fsdp_optim.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
CKPT = FIXTURES / "v2_adam_w2" / "ckpt"
FULL = FIXTURES / "v2_adam_w2" / "full.pt"
BLOCK1 = (1, 2, 3, 4)  # ids of block1.{0,2}.{weight,bias}: one FSDP unit, param group 0
BLOCK1_2_WEIGHT, BLOCK1_2_BIAS, UNUSED_WEIGHT = 3, 4, 7


def _full() -> dict[str, Any]:
    return torch.load(FULL, weights_only=True)


def _sharded(full: dict[str, Any], tmp_path: Path, world_size: int = 3) -> Path:
    torch.save(full, tmp_path / "edited.pt")
    fsdp_optim.reshard(tmp_path / "edited.pt", world_size, tmp_path / "edited", layout=CKPT)
    return tmp_path / "edited"


def _findings(path: Path, **kwargs: Any) -> dict[tuple[Any, ...], str]:
    report = fsdp_optim.verify(path, deep=True, **kwargs)
    assert all(f.ok for f in report.files), report.lines()
    return {(f.group, f.param, f.key): f.problem for f in report.findings}


def test_sound_state_of_every_kind_passes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fsdp_optim.reshard(CKPT, 3, tmp_path / "w3")
    fsdp_optim.to_safetensors(tmp_path / "w3", tmp_path / "named.safetensors")
    for path in (CKPT, tmp_path / "w3", tmp_path / "named.safetensors", FULL):
        report = fsdp_optim.verify(path, deep=True, layout=CKPT)
        assert report.ok and report.deep and not report.findings, report.lines()
    assert main(["verify", "--deep", str(tmp_path / "w3"), "--layout", str(CKPT)]) == 0
    assert "second moments >= 0" in capsys.readouterr().out


def test_negative_second_moment_and_nan_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    full = _full()
    full["state"][BLOCK1_2_WEIGHT]["exp_avg_sq"].view(-1)[[4, 7]] = torch.tensor([-1e-3, -2e-3])
    full["state"][BLOCK1_2_BIAS]["exp_avg"].view(-1)[1] = math.nan
    path = _sharded(full, tmp_path)
    assert fsdp_optim.verify(path).ok  # the checksums match: only reading the state finds these
    found = _findings(path)
    assert set(found) == {(None, "block1.2.weight", "exp_avg_sq"), (None, "block1.2.bias", "exp_avg")}
    assert found[None, "block1.2.weight", "exp_avg_sq"].startswith("2 negative values of 42 (min -0.002")
    assert found[None, "block1.2.bias", "exp_avg"].startswith("1 NaN and 0 Inf values of 6")
    code = main(["verify", "--deep", str(path)])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    assert "parameter 'block1.2.weight', state 'exp_avg_sq': 2 negative values" in out
    assert "2 findings a resumed run would trip on" in err
    code = main(["verify", "--deep", "--json", str(path)])
    record = json.loads(capsys.readouterr().out)
    assert code == 1 and record["ok"] is False and record["deep"] is True
    assert {(f["param"], f["key"]) for f in record["findings"]} == {
        ("block1.2.weight", "exp_avg_sq"), ("block1.2.bias", "exp_avg")
    }


def test_one_finding_is_said_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    full = _full()
    full["state"][BLOCK1_2_BIAS]["exp_avg"].view(-1)[1] = math.inf
    code = main(["verify", "--deep", str(_sharded(full, tmp_path))])
    err = capsys.readouterr().err
    assert code == 1 and ": 1 finding a resumed run would trip on: " in err, err


def test_hyperparameters_out_of_range(tmp_path: Path) -> None:
    full = _full()
    full["param_groups"][1]["lr"] = -0.01
    full["param_groups"][0].update(betas=(0.9, 1.0), eps=0.0, weight_decay=-1e-4)
    found = _findings(_sharded(full, tmp_path))
    assert set(found) == {(1, None, "lr"), (0, None, "betas[1]"), (0, None, "eps"), (0, None, "weight_decay")}
    assert found[1, None, "lr"] == "-0.01, expected a finite number >= 0"
    assert found[0, None, "betas[1]"] == "1.0, expected 0 <= beta < 1"
    report = fsdp_optim.verify(tmp_path / "edited", deep=True)
    assert "param group 1, 'lr': -0.01, expected a finite number >= 0" in report.lines()


def test_steps_that_disagree_in_a_param_group(tmp_path: Path) -> None:
    full = _full()
    for pid in BLOCK1:  # one unit of group 0 one step ahead of the rest of its group
        full["state"][pid]["step"] = torch.tensor(3.0)
    found = _findings(_sharded(full, tmp_path))
    names = ("block1.0.weight", "block1.0.bias", "block1.2.weight", "block1.2.bias")
    assert set(found) == {(0, name, "step") for name in names}
    assert found[0, "block1.0.weight", "step"].startswith("3.0, but 2.0 for 6 other parameters of its param group")


def test_layout_shapes_and_presence(tmp_path: Path) -> None:
    full = _full()
    for key in ("exp_avg", "exp_avg_sq"):  # unused.weight [3, 3] saved flat
        full["state"][UNUSED_WEIGHT][key] = full["state"][UNUSED_WEIGHT][key].reshape(9)
    pid = full["param_groups"][0]["params"].pop()  # head.bias left out
    name = full["param_names"].pop(pid)
    full["state"].pop(pid)
    torch.save(full, tmp_path / "edited.pt")
    assert fsdp_optim.verify(tmp_path / "edited.pt", deep=True).ok  # sound, as far as it goes
    found = _findings(tmp_path / "edited.pt", layout=CKPT)
    assert found == {
        (None, "unused.weight", None): "shape (9,) in the checkpoint, expected (3, 3) (the model's layout)",
        (None, name, None): "in the model's layout but not in the checkpoint",
    }
    code = main(["verify", str(tmp_path / "edited.pt"), "--layout", str(CKPT)])
    assert code == 1  # --layout without --deep is refused


def test_damaged_files_are_reported_before_any_state_is_read(tmp_path: Path) -> None:
    fsdp_optim.to_safetensors(FULL, tmp_path / "named.safetensors")
    raw = bytearray((tmp_path / "named.safetensors").read_bytes())
    raw[-5] ^= 0xFF
    (tmp_path / "named.safetensors").write_bytes(bytes(raw))
    report = fsdp_optim.verify(tmp_path / "named.safetensors", deep=True)
    assert not report.ok and not report.findings
    (check,) = report.files
    assert "fails its checksum" in check.detail
