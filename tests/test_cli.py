"""The ``fsdp-optim`` command line on real checkpoints written by a real world-size-2 job.

Most verbs run in-process through ``fsdp_optim.cli.main`` (exit codes, stdout, stderr captured); one
success and one failure go through ``python -m fsdp_optim`` in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks

import fsdp_optim
from fsdp_optim import consolidate, save_layout, save_sharded_optim_state, to_named
from fsdp_optim.cli import main
from fsdp_optim.formats.sharded.locate import read_manifest

ROOT = Path(__file__).resolve().parent.parent


def _job(rank: int, world_size: int, out: str) -> dict | None:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["sgd_momentum"](root.parameters())  # one group: fairscale's gather needs it
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    save_sharded_optim_state(root, optim, os.path.join(out, "ckpt"))
    full = root.gather_full_optim_state_dict(optim)
    native = FairscaleFSDP.gather_full_optim_state_dict(root, optim)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))
        torch.save(native, os.path.join(out, "native.pt"))
        save_layout(root, os.path.join(out, "layout.pt"))
        return full
    return None


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("cli")
    return out, run_ranks(_job, 2, str(out))[0]


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_inspect_every_kind_of_file(files, capsys) -> None:
    out, _ = files
    code, text, err = _run(capsys, "inspect", out / "ckpt", "--units")
    assert code == 0 and err == "", err
    for line in ("format: sharded checkpoint (version 3)", "optimizer: SGD", "world size: 2", "units: 5 (5 flat parameters)",
                 "params: 18 (16 with state)", "param groups: 1", "state keys: momentum_buffer (float32)", "step: -"):
        assert line in text, text
    assert "block2.inner | 3 | 4 |" in text and "files: 2 rank files" in text

    code, text, _ = _run(capsys, "inspect", out / "full.pt")
    assert code == 0 and "format: fsdp_optim full dict (version 1)" in text and "params: 18 (16 with state)" in text
    code, text, _ = _run(capsys, "inspect", out / "native.pt")
    assert code == 0 and "fairscale-native full dict" in text
    code, text, _ = _run(capsys, "inspect", out / "layout.pt")
    assert code == 0 and "format: layout file" in text and "state keys: -" in text
    assert (out / "layout.pt").read_bytes().startswith(b'{"fsdp_optim_checkpoint":{"kind":"manifest","version":3')
    rank_file = next((out / "ckpt").glob("optim-*rank00001*"))
    code, text, _ = _run(capsys, "inspect", rank_file)
    assert code == 0 and "rank: 1 of 2" in text


def test_consolidate_reshard_convert(files, capsys, tmp_path) -> None:
    out, full = files
    code, text, err = _run(capsys, "consolidate", out / "ckpt", "-o", tmp_path / "full.pt")
    assert code == 0 and err == "" and text.startswith(f"wrote {tmp_path / 'full.pt'}")  # no bars off a terminal
    written = torch.load(tmp_path / "full.pt", weights_only=True)
    layout = written["fsdp_optim"].pop("layout")  # the checkpoint's FSDP layout, recorded for reshard
    assert layout["param_order"] == list(read_manifest(out / "ckpt").param_order), layout
    assert_identical(written, full)

    for source, extra in ((out / "ckpt", ()), (out / "full.pt", ("--layout", out / "layout.pt"))):
        target = tmp_path / f"resharded-{source.name}"
        code, text, _ = _run(capsys, "reshard", source, "--world-size", 3, "-o", target, *extra)
        assert code == 0 and "3 rank files" in text
        assert read_manifest(target).world_size == 3
        assert_identical(consolidate(target), {**full, "fsdp_optim": {**full["fsdp_optim"], "world_size": 3}})

    code, _, _ = _run(capsys, "convert", out / "native.pt", "--layout", out / "ckpt", "--optimizer", "SGD",
                      "-o", tmp_path / "converted.pt")
    assert code == 0
    assert_identical(torch.load(tmp_path / "converted.pt", weights_only=True), full)
    for source in (out / "full.pt", out / "ckpt"):
        named = tmp_path / f"named-{source.stem}.pt"
        code, _, _ = _run(capsys, "convert", source, "--to", "named", "-o", named)
        assert code == 0
        assert_identical(torch.load(named, weights_only=True), to_named(full))


def test_bad_input_gives_one_line_and_exit_code_1(files, capsys, tmp_path) -> None:
    out, _ = files
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "emptydir").mkdir()
    cases = [
        (("inspect", tmp_path / "missing.pt"), "missing.pt: no such file"),
        (("inspect", tmp_path / "notes.txt"), "cannot be read with torch.load(weights_only=True)"),
        (("inspect", tmp_path / "emptydir"), "without a manifest.json or manifest.pt"),
        (("consolidate", tmp_path / "emptydir", "-o", tmp_path / "x.pt"), "not a sharded checkpoint directory"),
        (("reshard", out / "full.pt", "--world-size", 2, "-o", tmp_path / "r"), "--layout: resharding a full dict"),
        (("convert", out / "native.pt", "-o", tmp_path / "c.pt"), "needs --layout"),
        (("convert", out / "full.pt", "-o", tmp_path / "c.pt"), "already a full dict"),
        (("convert", out / "native.pt", "--layout", tmp_path / "notes.txt", "-o", tmp_path / "c.pt"),
         "notes.txt: cannot be read"),
    ]
    for argv, message in cases:
        code, text, err = _run(capsys, *argv)
        assert code == 1 and text == "", (argv, text)
        assert err.startswith("fsdp-optim: error: ") and err.count("\n") == 1 and message in err, (argv, err)
    for count in ("two", "0"):  # bad usage (exit 2), before the source is opened
        with pytest.raises(SystemExit) as usage:
            main(["reshard", str(out / "ckpt"), "--world-size", count, "-o", str(tmp_path / "r")])
        assert usage.value.code == 2
        assert "argument --world-size: expected an integer >= 1" in capsys.readouterr().err


def test_python_dash_m_in_a_fresh_interpreter(files) -> None:
    out, _ = files
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ok = subprocess.run([sys.executable, "-m", "fsdp_optim", "inspect", str(out / "ckpt")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0 and "world size: 2" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "fsdp_optim", "consolidate", str(out), "-o", str(out / "x.pt")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("fsdp-optim: error: ") and bad.stderr.count("\n") == 1, bad.stderr


def test_version_and_help_for_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and fsdp_optim.__version__ in capsys.readouterr().out
    from fsdp_optim.cli.parser import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "verb")
    for verb, sub in verbs.choices.items():  # type: ignore[union-attr]
        for action in sub._actions:
            assert action.help, f"{verb} {action.option_strings or action.dest} has no help text"
