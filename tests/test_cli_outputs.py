"""The command line reads what it writes (``convert --to named``, ``--to dcp``), ``inspect --json`` and
``inspect --units`` (parameter names and shapes), on the checked-in format-2 fixture (no process group)."""

from __future__ import annotations

import json
import shutil
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
    assert "optimizer.state.embed.weight.exp_avg | float32 | [11, 6]" in text, text


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
    assert report["world_size"] == 2 and report["format"].startswith("sharded checkpoint"), report
    units = {row["unit"]: row for row in report["units"]}
    assert units["block2"]["params"] == [{"name": "block2.proj.weight", "shape": [5, 6]},
                                         {"name": "block2.proj.bias", "shape": [5]}], units  # fmt: skip
    assert len(units) == 5 and units["frozen"]["state"] == [], units
    code, text, _ = _run(capsys, "inspect", FIXTURE / "full.pt", "--json")
    report = json.loads(text)
    assert code == 0 and (report["params"], report["params_with_state"]) == (18, 16), text


# The members of inspect --json (docs/cli.md) and the JSON types each may take, whatever the input.
_SCHEMA: dict[str, tuple[type, ...]] = {
    "schema": (int,), "path": (str,), "kind": (str,), "format": (str,), "version": (int, type(None)),
    "optimizer": (str, type(None)), "world_size": (int, type(None)), "params": (int, type(None)),
    "params_with_state": (int, type(None)), "param_groups": (int, type(None)), "state_keys": (dict,),
    "steps": (list,), "state_bytes": (int, type(None)), "padding_elements": (int, type(None)),
    "files": (dict, type(None)), "units": (list,), "model": (dict, type(None)), "details": (dict,),
}  # fmt: skip
_UNIT = {"unit", "flat", "numel", "world_size", "padding", "dtype", "state", "params"}


def check_inspect_json(text: str, kind: str) -> dict:
    """``inspect --json``'s output has every member of the schema, of its type, numbers as numbers."""
    report = json.loads(text)
    assert list(report) == list(_SCHEMA), list(report)
    for key, types in _SCHEMA.items():
        assert type(report[key]) in types, f"{kind}: {key} is {report[key]!r}"
    assert report["kind"] == kind and report["schema"] == 1, report
    for unit in report["units"]:
        assert set(unit) == _UNIT, unit
        assert all(set(p) == {"name", "shape"} and isinstance(p["name"], str) for p in unit["params"]), unit
        assert all(type(n) is int for p in unit["params"] if p["shape"] is not None for n in p["shape"]), unit
    assert all(type(v) is int and v >= 0 for v in (report["files"] or {}).values()), report["files"]
    numbers = {k: v for k, v in report["details"].items() if k != "optimizer_key"}  # a DCP directory's: a name
    assert all(type(v) is int or v is None for v in numbers.values()), report["details"]
    assert type(report["details"].get("optimizer_key", "")) in (str, type(None)), report["details"]
    return report


def test_inspect_json_has_one_schema_for_every_kind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    made = {
        "named": ("convert", FIXTURE / "ckpt", "--to", "safetensors", "-o", tmp_path / "named.safetensors"),
        "named_dict": ("convert", FIXTURE / "full.pt", "--to", "named", "-o", tmp_path / "named.pt"),
        "dcp": ("convert", FIXTURE / "ckpt", "--to", "dcp", "-o", tmp_path / "dcp"),
    }
    for argv in made.values():
        assert _run(capsys, *argv)[0] == 0
    rank_file = sorted((FIXTURE / "ckpt").glob("optim-*rank00001*"))[0]
    inputs = {"sharded": FIXTURE / "ckpt", "full": FIXTURE / "full.pt", "rank_file": rank_file,
              **{kind: argv[-1] for kind, argv in made.items()}}  # fmt: skip
    for kind, path in inputs.items():
        code, text, err = _run(capsys, "inspect", path, "--json")
        assert code == 0 and err == "", err
        report = check_inspect_json(text, kind)
        if kind not in ("rank_file", "dcp"):
            assert report["params"] == 18 and report["params_with_state"] == 16 and report["units"], report
        if kind not in ("rank_file", "dcp", "named_dict"):  # a name-keyed dict records neither
            assert report["optimizer"] == "Adam" and report["world_size"] == 2, report
    details = {kind: check_inspect_json(_run(capsys, "inspect", inputs[kind], "--json")[1], kind)["details"]
               for kind in ("rank_file", "dcp")}  # fmt: skip
    assert (details["rank_file"]["rank"], details["rank_file"]["world_size"]) == (1, 2), details
    assert details["dcp"]["optimizer_params"] == 16 and details["dcp"]["param_groups"] == 2, details


def test_an_output_that_cannot_be_written_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a_file").write_bytes(b"x")
    out = tmp_path / "a_file" / "named.pt"
    code, _, err = _run(capsys, "convert", FIXTURE / "full.pt", "--to", "named", "-o", out)
    assert code == 1 and err.startswith(f"fsdp-optim: error: {out}: cannot write this output"), err


@pytest.mark.parametrize(
    "argv",
    [
        ("consolidate", FIXTURE / "ckpt", "-o", "{out}"),
        ("convert", FIXTURE / "ckpt", "--to", "full", "-o", "{out}"),
        ("convert", FIXTURE / "ckpt", "--to", "named", "-o", "{out}"),
        ("convert", FIXTURE / "ckpt", "--to", "safetensors", "-o", "{out}"),
    ],
    ids=["consolidate", "convert-full", "convert-named", "convert-safetensors"],
)
def test_an_existing_output_file_is_replaced_only_with_overwrite(tmp_path: Path, capsys, argv) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes, not a checkpoint\n")
    args = [str(a).replace("{out}", str(notes)) for a in argv]
    code, text, err = _run(capsys, *args)
    assert code == 1 and text == "", (code, text, err)
    assert err.startswith(f"fsdp-optim: error: {notes}: exists already") and "--overwrite" in err, err
    assert err.count("\n") == 1 and notes.read_bytes() == b"my notes, not a checkpoint\n"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"], "no temporary file left"
    code, text, err = _run(capsys, *args, "--overwrite")
    assert code == 0 and text.startswith(f"wrote {notes}") and err == "", (text, err)
    assert notes.read_bytes() != b"my notes, not a checkpoint\n"


_VERBS = {  # verb -> its arguments around one input path (and an output where it writes)
    "inspect": ("inspect", "{in}"),
    "consolidate": ("consolidate", "{in}", "-o", "{out}"),
    "reshard": ("reshard", "{in}", "--world-size", "2", "-o", "{out}"),
    "convert": ("convert", "{in}", "-o", "{out}"),
    "verify": ("verify", "{in}"),
    "verify-deep": ("verify", "{in}", "--deep"),
    "diff": ("diff", FIXTURE / "ckpt", "{in}"),
    "list": ("list", "{in}"),
}


@pytest.mark.parametrize("verb", sorted(_VERBS))
def test_every_verb_exits_1_on_bad_input_and_2_on_bad_usage(tmp_path: Path, capsys, verb: str) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a checkpoint")
    args = [str(a).replace("{in}", str(bad)).replace("{out}", str(tmp_path / "out")) for a in _VERBS[verb]]
    code, text, err = _run(capsys, *args)
    trouble = 2 if verb == "diff" else 1  # diff: diff(1)'s codes, 1 is "different"
    assert code == trouble and (text == "" or verb.startswith("verify")), (args, code, text, err)  # verify: report
    assert err.startswith("fsdp-optim: error: ") and err.count("\n") == 1 and str(bad) in err, (args, err)
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as usage:
        main([*args, "--no-such-option"])
    assert usage.value.code == 2, args
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_a_checkpoint_and_a_manager_root_each_point_at_the_verbs_that_read_them(tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURE / "ckpt", root / "step-00000004")
    code, text, err = _run(capsys, "list", root / "step-00000004")
    assert code == 1 and text == "" and "a checkpoint (a step directory), not a CheckpointManager root" in err, err
    assert f"fsdp-optim inspect {root / 'step-00000004'}" in err and "fsdp-optim verify" in err, err
    for verb in ("inspect", "verify"):
        code, _, err = _run(capsys, verb, root)
        assert code == 1 and f"a CheckpointManager root, whose steps `fsdp-optim list {root}` shows" in err, err
    code, text, err = _run(capsys, "list", root, "--memory-dir", "default", "--quick")
    lines = text.splitlines()
    assert code == 0 and lines[0].startswith("step 4  complete") and err == "", (text, err)
    assert lines[1].startswith("memory tier: no complete step held under /"), lines
