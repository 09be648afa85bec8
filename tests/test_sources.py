"""The one way in (``offline/sources.py``): every verb and offline function decides what its input is in one
place and accepts or refuses ``--layout`` / ``--optimizer`` by one table, the same way everywhere; a
``--optimizer`` is checked against torch.optim's names and the state keys found. And the CLI's reshard
replaces a checkpoint already in its output only with ``--overwrite``.

Real files from a real world-size-2 fairscale job (SGD with momentum: state ``momentum_buffer``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from test_cli import _job  # the same real job: a sharded checkpoint, its full dict, fairscale's native dict

from fsdp_optim import consolidate, reshard
from fsdp_optim.cli import main
from fsdp_optim.formats.kinds import Kind, detect
from fsdp_optim.formats.sharded.locate import read_manifest


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("sources")
    run_ranks(_job, 2, str(where))
    return where


def _cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.err


def test_detect_names_every_kind(out: Path) -> None:
    assert detect(out / "ckpt")[0] is Kind.SHARDED
    assert detect(out / "full.pt")[0] is Kind.FULL
    assert detect(out / "native.pt")[0] is Kind.NATIVE
    with pytest.raises(FileNotFoundError):
        detect(out / "missing.pt")


@pytest.mark.parametrize("verb", ["consolidate", "convert", "reshard"])
def test_an_option_that_does_not_apply_is_refused_the_same_way_by_every_verb(out: Path, tmp_path: Path, capsys,
                                                                            verb: str) -> None:
    extra = ["--world-size", 2] if verb == "reshard" else []
    for flag, value, message in [
        ("--optimizer", "SGD", "--optimizer: "),
        ("--layout", out / "ckpt", "--layout: "),
    ]:
        code, err = _cli(capsys, verb, out / "ckpt", flag, value, "-o", tmp_path / f"{verb}.out", *extra)
        assert code == 1, (verb, flag, err)
        assert err.startswith(f"fsdp-optim: error: {message}") and "is a sharded checkpoint" in err, (verb, flag, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refusal wrote nothing"


def test_optimizer_is_checked_against_names_and_the_state_found(out: Path, tmp_path: Path, capsys) -> None:
    layout = ["--layout", out / "ckpt"]
    code, err = _cli(capsys, "convert", out / "native.pt", *layout, "--optimizer", "Adamm", "-o", tmp_path / "a.pt")
    assert code == 1 and "'Adamm' is not an optimizer fsdp_optim knows" in err, err
    code, err = _cli(capsys, "convert", out / "native.pt", *layout, "--optimizer", "Adam", "-o", tmp_path / "b.pt")
    assert code == 1 and "['momentum_buffer']" in err and "Adam keeps only" in err, err
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()
    code, err = _cli(capsys, "convert", out / "native.pt", *layout, "--optimizer", "SGD", "-o", tmp_path / "c.pt")
    assert code == 0, err
    assert torch.load(tmp_path / "c.pt", weights_only=True)["fsdp_optim"]["optimizer"] == "SGD"


def test_the_api_refuses_what_the_cli_refuses(out: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="optimizer: .* is a sharded checkpoint, which records its optimizer"):
        consolidate(out / "ckpt", optimizer="SGD")
    with pytest.raises(ValueError, match="layout: .* is a sharded checkpoint"):
        reshard(out / "ckpt", 2, tmp_path / "r", layout=out / "ckpt")
    with pytest.raises(ValueError, match="Adam keeps only"):
        consolidate(out / "native.pt", layout=out / "ckpt", optimizer="Adam")
    assert not (tmp_path / "r").exists()


def test_cli_reshard_replaces_a_checkpoint_only_with_overwrite(out: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "target"
    assert _cli(capsys, "reshard", out / "ckpt", "--world-size", 3, "-o", target)[0] == 0
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    code, err = _cli(capsys, "reshard", out / "ckpt", "--world-size", 1, "-o", target)
    assert code == 1 and "already holds a checkpoint" in err and "--overwrite" in err, err
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before, "the refused reshard changed the target"
    assert _cli(capsys, "reshard", out / "ckpt", "--world-size", 1, "-o", target, "--overwrite")[0] == 0
    assert read_manifest(target).world_size == 1
    # The API keeps replacing atomically, as a periodic job's saves do.
    reshard(out / "ckpt", 2, target)
    assert read_manifest(target).world_size == 2
