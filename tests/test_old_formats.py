"""Checkpoints written by earlier versions still read: the committed fixtures of formats 1 and 2
(``tests/fixtures/v1_adam_w2``, ``v2_adam_w2``) consolidate to exactly the full dict fairscale gathered then, load
into a world-size-2 job exactly as fairscale cuts that dict, reshard into format 3, and ``inspect`` says which
format each is; a writer replacing a format-1 checkpoint with one of format 3 removes ``manifest.pt`` and the old
files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from _checks import assert_identical, loads_old_fixture_exactly
from _dist import run_ranks

from fsdp_optim import consolidate, reshard
from fsdp_optim.cli import main as cli
from fsdp_optim.formats.sharded.file_record import CHECKPOINT_VERSION
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "v1_adam_w2"
OLD = {1: FIXTURES / "v1_adam_w2", 2: FIXTURES / "v2_adam_w2"}  # checkpoints written by earlier versions


def _fixture_full(fixture: Path = FIXTURE) -> dict:
    return torch.load(fixture / "full.pt", weights_only=True)


@pytest.mark.parametrize("version", sorted(OLD))
def test_old_format_fixtures_consolidate_exactly(tmp_path: Path, version: int) -> None:
    fixture = OLD[version]
    assert read_manifest(fixture / "ckpt").version == version
    assert_identical(consolidate(fixture / "ckpt"), _fixture_full(fixture), f"format {version} consolidated")
    assert_identical(consolidate(fixture / "ckpt", max_mapped_bytes=1), _fixture_full(fixture), "tight")
    # Resharded into the current format (a new checkpoint always is), then back to two ranks: same bits.
    reshard(fixture / "ckpt", 3, tmp_path / "ws3")
    reshard(tmp_path / "ws3", 2, tmp_path / "ws2")
    assert read_manifest(tmp_path / "ws3").version == CHECKPOINT_VERSION == 3
    full = consolidate(tmp_path / "ws2")
    assert_identical(full, _fixture_full(fixture), f"format {version} -> 3 (3 ranks) -> 3 (2 ranks)")



@pytest.mark.parametrize("version", sorted(OLD))
def test_old_format_fixtures_load_exactly_in_a_job(version: int) -> None:
    assert all(run_ranks(loads_old_fixture_exactly, 2, str(OLD[version])))


def test_inspect_names_the_format_version(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for version, fixture in OLD.items():
        assert cli(["inspect", str(fixture / "ckpt")]) == 0
        assert f"format: sharded checkpoint (version {version})" in capsys.readouterr().out
    reshard(FIXTURE / "ckpt", 2, tmp_path / "v3")
    assert cli(["inspect", str(tmp_path / "v3")]) == 0
    assert "format: sharded checkpoint (version 3)" in capsys.readouterr().out
    assert cli(["inspect", str(tmp_path / "v3" / MANIFEST_NAME)]) == 0
    assert "(version 3)" in capsys.readouterr().out


def test_a_format3_commit_over_format1_removes_the_old_files(tmp_path: Path) -> None:
    target = Path(shutil.copytree(FIXTURE / "ckpt", tmp_path / "ckpt"))
    reshard(FIXTURE / "ckpt", 3, target)  # into the directory that holds the format-1 checkpoint
    manifest = read_manifest(target)
    assert manifest.version == 3
    assert sorted(os.listdir(target)) == sorted([MANIFEST_NAME, *(f.file for f in manifest.files)])
    assert_identical(consolidate(target)["state"], _fixture_full()["state"], "format 3 over format 1")
