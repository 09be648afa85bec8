"""The command line reads what it writes (``convert --to named``, ``--to dcp``), ``inspect --json`` and
``inspect --units`` (parameter names and shapes), on the checked-in format-2 fixture (no process group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_optim.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v2_adam_w2"


def _run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_reads_a_named_dict_and_a_dcp_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _run(capsys, "convert", FIXTURE / "full.pt", "--to", "named", "-o", tmp_path / "named.pt")[0] == 0
    code, text, err = _run(capsys, "inspect", tmp_path / "named.pt", "--units")
    assert code == 0 and err == "", err
    assert "format: name-keyed dict" in text and "params: 18 (16 with state)" in text, text
    assert "embed.weight | step float32 [], exp_avg float32 [11, 6]" in text, text

    assert _run(capsys, "convert", FIXTURE / "ckpt", "--to", "dcp", "-o", tmp_path / "dcp")[0] == 0
    code, text, err = _run(capsys, "inspect", tmp_path / "dcp", "--units")
    assert code == 0 and err == "", err
    assert "format: PyTorch DCP checkpoint" in text and "optimizer: state of 16 params" in text, text
    assert "optim.state.embed.weight.exp_avg | float32 | [11, 6]" in text, text


def test_what_only_inspect_reads_is_refused_by_the_other_verbs(tmp_path: Path, capsys) -> None:
    assert _run(capsys, "convert", FIXTURE / "full.pt", "--to", "named", "-o", tmp_path / "named.pt")[0] == 0
    code, _, err = _run(capsys, "convert", tmp_path / "named.pt", "-o", tmp_path / "out.pt")
    assert code == 1 and "name-keyed dict" in err and "set_optimizer_state_dict" in err, err
    assert _run(capsys, "convert", FIXTURE / "full.pt", "--to", "dcp", "-o", tmp_path / "dcp")[0] == 0
    code, _, err = _run(capsys, "verify", tmp_path / "dcp")
    assert code == 1 and "PyTorch DCP checkpoint, which records no checksums" in err, err


def test_inspect_json_and_units(capsys: pytest.CaptureFixture) -> None:
    code, text, err = _run(capsys, "inspect", FIXTURE / "ckpt", "--units", "--json")
    assert code == 0 and err == "", err
    report = json.loads(text)
    assert report["world size"] == "2" and report["format"].startswith("sharded checkpoint"), report
    units = {row["unit"]: row for row in report["unit rows"]}
    assert units["block2"]["param shapes"] == "block2.proj.weight [5, 6], block2.proj.bias [5]", units
    assert len(units) == 5 and units["frozen"]["state"] == "-", units
    code, text, _ = _run(capsys, "inspect", FIXTURE / "full.pt", "--json")
    assert code == 0 and json.loads(text)["params"] == "18 (16 with state)", text


def test_an_output_that_cannot_be_written_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a_file").write_bytes(b"x")
    out = tmp_path / "a_file" / "named.pt"
    code, _, err = _run(capsys, "convert", FIXTURE / "full.pt", "--to", "named", "-o", out)
    assert code == 1 and err.startswith(f"fsdp-optim: error: {out}: cannot write this output"), err
