"""What a new user reads: warnings that point at their own line, the cheap checks saying they did not read the data,
and the requirements the quick start lists being the package's."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import _models as M
import pytest
import torch
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _two_steps(rank: int, world_size: int, root: str) -> None:
    manager = fsdp_optim.CheckpointManager(root, every=1, keep=5)
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    for step in (1, 2):
        M.train_step(model, optim, *M.local_batch(step - 1, rank, world_size))
        manager.save(step, model, optim)


def test_inspect_and_list_quick_say_they_did_not_check_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    run_ranks(_two_steps, 1, str(root))
    victim = sorted((root / "step-00000002").glob("optim-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))

    assert main(["inspect", str(root / "step-00000002")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("not verified:") and "fsdp-optim verify" in last, last

    assert main(["list", "--quick", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "complete" in lines[1] and lines[-1].startswith("not verified (--quick)"), lines
    assert main(["list", "--quick", "--json", str(root)]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is False
    assert main(["list", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "damaged" in lines[1] and not any(line.startswith("not verified") for line in lines), lines


def test_a_manager_warning_points_at_the_callers_line(tmp_path: Path) -> None:
    (tmp_path / "step-00000005").mkdir()  # torn: a save killed before it wrote anything
    manager = fsdp_optim.CheckpointManager(tmp_path, every=1, keep=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_of_next_call()
        assert manager.restore(torch.nn.Linear(2, 2), None) is None, "nothing complete: a fresh run"
    said = [w for w in caught if "skipped step 5" in str(w.message)]
    assert said, [str(w.message) for w in caught]
    assert (said[0].filename, said[0].lineno) == (__file__, line), (said[0].filename, said[0].lineno)


def _line_of_next_call() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None, "called from a function"
    return frame.f_back.f_lineno + 1


def test_the_quick_start_lists_every_requirement() -> None:
    setup = (ROOT / "setup.py").read_text()
    required = re.findall(r'^\s*"([a-z][\w-]*[<>=][^"]*)",', setup.split("install_requires=[")[1].split("]")[0], re.M)
    assert len(required) >= 6, required
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    for requirement in required:
        assert f"`{requirement}`" in quickstart, f"docs/quickstart.md does not list {requirement}"
