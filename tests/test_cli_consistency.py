"""What a new user hit on the command line: ``verify`` passing any torch file, a model's state_dict refused
for its tied weights instead of as no checkpoint, a DCP export whose optimizer key was neither said nor chosen nor
seen by ``inspect``, bad numbers exiting 1 instead of 2, an ``-o`` whose name or kind (a directory) the verb could not
write, and ``verify --json``'s ``kind`` meaning something else than ``inspect --json``'s. Each test failed before its
fix. On the checked-in format-2 fixture (no process group); the whole checkpoint's cases are in test_whole_offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_optim.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v2_adam_w2"


def _run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _usage(capsys: pytest.CaptureFixture, *argv: object) -> str:
    """Run a command that must be refused as bad usage (exit 2); its stderr."""
    with pytest.raises(SystemExit) as usage:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert usage.value.code == 2, (argv, err)
    return err


def _model_files(tmp_path: Path) -> dict[str, Path]:
    plain = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), plain)
    embed = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = embed.weight  # tied, as a language model's input and output embeddings
    tied = tmp_path / "tied.pt"
    torch.save(torch.nn.Sequential(embed, head).state_dict(), tied)
    return {"plain": plain, "tied": tied}


@pytest.mark.parametrize("which", ["plain", "tied"])
def test_verify_refuses_a_model_state_dict_as_inspect_does(tmp_path: Path, capsys, which: str) -> None:
    """Before: verify said "verified: 1 files ... checksums matching" (exit 0) of a plain state_dict, and inspect
    refused a tied one for "referenced 2 times" (verify: "damaged"); now both say it is no checkpoint, alike."""
    path = _model_files(tmp_path)[which]
    code, out, inspected = _run(capsys, "inspect", path)
    assert code == 1 and out == "", out
    assert f"{path}: not a checkpoint: it looks like a model's state_dict()" in inspected, inspected
    assert "0.weight" in inspected or "weight" in inspected, inspected
    assert "shares memory" not in inspected and "referenced" not in inspected, inspected
    code, out, verified = _run(capsys, "verify", path)
    assert code == 1 and "verified" not in out, out
    assert verified == inspected, (verified, inspected)
    code, out, _ = _run(capsys, "verify", path, "--json")
    assert code == 1 and out == "", out


def test_verify_json_kind_means_what_inspect_json_kind_means(capsys) -> None:
    """Before: inspect --json said "kind": "sharded", verify --json "kind": "sharded checkpoint" (and "file" for a full
    dict): now both give the input's kind, and verify's text format line is its "format"."""
    for path, kind in ((FIXTURE / "ckpt", "sharded"), (FIXTURE / "full.pt", "full")):
        code, out, err = _run(capsys, "inspect", path, "--json")
        inspected = json.loads(out)
        code2, out2, err2 = _run(capsys, "verify", path, "--json")
        verified = json.loads(out2)
        assert code == code2 == 0, err + err2
        assert inspected["kind"] == verified["kind"] == kind, (inspected["kind"], verified)
        assert verified["schema"] == 1 and verified["ok"] is True, verified
        code, text, _ = _run(capsys, "verify", path)
        assert f"format: {verified['format']}" in text, (verified["format"], text)


def test_dcp_export_names_its_optimizer_key_and_inspect_finds_it(tmp_path: Path, capsys) -> None:
    """The key the optimizer state went under is printed (default "optimizer", as torchtitan's), can be chosen, and
    inspect counts the state under whatever key it is (before: only under "optim": 0 params otherwise)."""
    for given, key in ((None, "optimizer"), ("optim", "optim"), ("opt_state", "opt_state")):
        out_dir = tmp_path / f"dcp-{key}"
        flag = [] if given is None else ["--optim-key", given]
        code, out, err = _run(capsys, "convert", FIXTURE / "ckpt", "--to", "dcp", "-o", out_dir, *flag)
        assert code == 0 and f"optimizer state of 16 params under '{key}'" in out, out + err
        assert f"'{key}': ..." in out, out
        code, out, err = _run(capsys, "inspect", out_dir)
        assert code == 0 and "optimizer: state of 16 params" in out and "; 2 param groups" in out, out + err
        assert f"optimizer key: {key} " in out, out
        code, out, err = _run(capsys, "inspect", out_dir, "--json")
        details = json.loads(out)["details"]
        assert (details["optimizer_params"], details["param_groups"], details["optimizer_key"]) == (16, 2, key), details
    err = _usage(capsys, "convert", FIXTURE / "ckpt", "--to", "full", "--optim-key", "x", "-o", tmp_path / "f.pt")
    assert "--optim-key applies to --to dcp only" in err, err
    err = _usage(capsys, "convert", FIXTURE / "ckpt", "--to", "dcp", "--optim-key", "a.b", "-o", tmp_path / "d")
    assert "without '.'" in err, err
    assert not (tmp_path / "f.pt").exists() and not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["reshard", "{ckpt}", "--world-size", "0", "-o", "{tmp}/w0"], "argument --world-size: expected an integer >= 1"),
        (["reshard", "{ckpt}", "--world-size", "two", "-o", "{tmp}/w2"], "argument --world-size: expected an integer"),
        (["consolidate", "{ckpt}", "--rank", "-1", "-o", "{tmp}/c.pt"], "argument --rank: expected an integer >= 0"),
        (["diff", "{ckpt}", "{full}", "--atol", "-1"], "argument --atol: expected a finite number >= 0"),
        (["diff", "{ckpt}", "{full}", "--rtol", "nan"], "argument --rtol: expected a finite number >= 0"),
        (["consolidate", "{full}", "-o", "{tmp}/x.safetensors"], "convert SOURCE --to safetensors"),
        (["consolidate", "{ckpt}", "--no-model", "--with-model", "-o", "{tmp}/c.pt"], "contradict"),
    ],
    ids=["world-size-0", "world-size-text", "rank-negative", "atol-negative", "rtol-nan", "consolidate-safetensors",
         "no-and-with-model"],
)  # fmt: skip
def test_bad_usage_exits_2_before_reading_anything(tmp_path: Path, capsys, argv: list[str], expected: str) -> None:
    """Before: --world-size 0 exited 1 (bad input) after opening the source, and consolidate -o x.safetensors wrote
    a torch zip under that name (now: one safetensors file of our sharded checkpoint; of any other source, refused)."""
    args = [a.format(ckpt=FIXTURE / "ckpt", full=FIXTURE / "full.pt", tmp=tmp_path) for a in argv]
    err = _usage(capsys, *args)
    assert expected in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_output_is_refused_where_one_file_is_written(tmp_path: Path, capsys, overwrite: bool) -> None:
    """Before: consolidate -o DIR suggested --overwrite, which then failed with "Is a directory"."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    flag = ["--overwrite"] if overwrite else []
    for verb in (["consolidate", FIXTURE / "ckpt"], ["convert", FIXTURE / "ckpt", "--to", "full"]):
        code, out, err = _run(capsys, *verb, "-o", taken, *flag)
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert f"-o {taken}: an existing directory" in err and "Is a directory" not in err, err
        assert "--overwrite" not in err, err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


def test_consolidate_takes_a_source_and_with_model_is_deprecated(tmp_path: Path, capsys) -> None:
    """Its argument is SOURCE (it takes files too, not only a directory); --with-model (the default) still works,
    with a warning, and is gone from --help, so only --no-model is offered."""
    with pytest.raises(SystemExit):
        main(["consolidate", "--help"])
    text = capsys.readouterr().out
    positional = text.split("positional arguments:")[1].split("options:")[0]
    assert positional.split()[0] == "SOURCE", positional
    assert "--no-model" in text and "--with-model" not in text, text
    code, out, err = _run(capsys, "consolidate", FIXTURE / "ckpt", "-o", tmp_path / "c.pt")
    assert code == 0 and err == "", err
    code, out, err = _run(capsys, "consolidate", FIXTURE / "ckpt", "-o", tmp_path / "w.pt", "--with-model")
    assert code == 1 and "--with-model is deprecated" in err, err  # a sharded optimizer-only checkpoint: no weights
    assert "--with-model is for a fairseq/metaseq shard set or a whole checkpoint" in err, err


def test_a_checksum_mismatch_names_the_shards_own_elements() -> None:
    """Before: a chunk that began in the previous shard gave "elements -12000..4384 ... of tensor 'float32'": a
    negative index, and the dtype the rank file groups its data by read as a tensor's name."""
    from fsdp_optim.formats.sharded.segments import Grid, Placement, shard_mismatch

    grid = Grid("float32", 0, 40000, ("x",) * 3)
    shard = Placement(flat=3, key="exp_avg", tensor="float32", offset=28384, numel=4384, grid=grid)
    message = shard_mismatch(shard, 16384, "rank1.safetensors", 1)
    assert "elements 0..4384 of state 'exp_avg'" in message, message
    assert "-" not in message.split("elements ", 1)[1].split(" ", 1)[0], message
    assert "of tensor 'float32'" not in message and "rank file's float32 data" in message, message
