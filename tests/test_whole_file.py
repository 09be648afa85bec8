"""The file ``consolidate`` writes for a whole checkpoint (``{"model", "optimizer", "extra"}``, a tied parameter
under two names) read back by every verb: inspect, verify --deep, consolidate, reshard, diff and load_checkpoint;
the checkpoint is written by 2 real fairscale ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from test_whole_offline import _content, _load_all
from test_whole_state import _extra, _save, make_net

import fsdp_optim
from fsdp_optim.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A whole checkpoint of 2 ranks and the file ``fsdp-optim consolidate`` writes of it."""
    root = tmp_path_factory.mktemp("whole_file")
    run_ranks(_save, 2, str(root / "step3"), False)
    assert main(["consolidate", str(root / "step3"), "-o", str(root / "whole.pt")]) == 0
    return root / "step3", root / "whole.pt"


def _without_layout(whole: dict) -> dict:
    """A consolidated whole file's content without the layout its optimizer's block records (for reshard)."""
    return {**whole, "optimizer": {**whole["optimizer"], "fsdp_optim": {
        k: v for k, v in whole["optimizer"]["fsdp_optim"].items() if k != "layout"}}}  # fmt: skip


def _edited(path: Path, out: Path, name: str, value: float) -> Path:
    """A copy of the whole file with weight ``name``'s first element set to ``value``."""
    obj = torch.load(path, weights_only=True)
    obj["model"][name].view(-1)[0] = value
    torch.save(obj, out)
    return out


def test_inspect_reads_it(files, capsys) -> None:
    _, whole = files
    assert main(["inspect", str(whole)]) == 0
    lines = capsys.readouterr().out.splitlines()
    params = len(list(make_net().parameters()))
    assert lines[1].startswith("format: consolidated whole checkpoint file"), lines
    assert "optimizer: Adam" in lines and "world size: 2" in lines
    assert any(line.startswith(f"model: {params} params + 1 tied names (head.weight -> embed.weight)") for line in lines)
    assert "buffers: 1 (block1.seen)" in lines
    assert "extra: step, rank, rng, scheduler, $odd key" in lines


def test_verify_deep_reads_it_and_sees_its_weights(files, tmp_path, capsys) -> None:
    _, whole = files
    report = fsdp_optim.verify(whole, deep=True)
    assert report.ok and report.kind.startswith("consolidated whole checkpoint file"), report.lines()
    assert main(["verify", "--deep", str(whole)]) == 0
    capsys.readouterr()
    bad = _edited(whole, tmp_path / "inf.pt", "block1.0.weight", float("inf"))
    report = fsdp_optim.verify(bad, deep=True)
    assert [(f.param, f.key) for f in report.findings] == [("block1.0.weight", "@param")], report.findings


def test_consolidate_reads_it(files, tmp_path) -> None:
    path, whole = files
    again = fsdp_optim.consolidate(whole)
    assert again["optimizer"]["fsdp_optim"]["layout"]["world_size"] == 2, "the checkpoint's layout, recorded"
    assert_identical(_without_layout(again), fsdp_optim.consolidate(path), "consolidated twice")
    assert again["model"]["head.weight"] is again["model"]["embed.weight"], "a tied parameter stays one tensor"
    assert_identical(_without_layout({"optimizer": fsdp_optim.consolidate(whole, with_model=False)})["optimizer"],
                     fsdp_optim.consolidate(path, with_model=False), "optimizer")  # fmt: skip
    assert main(["consolidate", str(whole), "-o", str(tmp_path / "again.pt")]) == 0
    assert_identical(torch.load(tmp_path / "again.pt", weights_only=True), torch.load(whole, weights_only=True), "file")
    assert main(["consolidate", str(whole), "--no-model", "-o", str(tmp_path / "optim.pt")]) == 0
    assert_identical(torch.load(tmp_path / "optim.pt", weights_only=True), again["optimizer"], "optimizer file")


def test_diff_reads_it_weights_included(files, tmp_path) -> None:
    path, whole = files
    same = fsdp_optim.diff(path, whole)
    assert {row.key for row in same.rows} >= {"@param", "exp_avg"}, same.rows
    # The file keeps saved rank 0's extra: rank 1's is named as not compared, so the report is not "equal".
    assert {(r.param, r.status) for r in same.differences} == {("extra of rank 1", "not compared")}, same.differences
    assert not same.equal, "never equal over a part it did not compare"
    moved = fsdp_optim.diff(path, _edited(whole, tmp_path / "moved.pt", "block1.0.weight", 7.0))
    assert not moved.equal
    changed = {(r.param, r.key) for r in moved.rows if r.status not in ("equal", "not compared")}
    assert changed == {("block1.0.weight", "@param")}, changed


def test_reshard_reads_it_into_a_whole_checkpoint(files, tmp_path, capsys) -> None:
    from fsdp_optim.formats.sharded.locate import read_manifest

    path, whole = files
    unrecorded = tmp_path / "unrecorded.pt"  # a file that records no layout (the API's dict, saved by hand)
    torch.save(fsdp_optim.consolidate(path), unrecorded)
    with pytest.raises(ValueError, match="layout"):
        fsdp_optim.reshard(unrecorded, 3, tmp_path / "no_layout")
    fsdp_optim.reshard(whole, 3, tmp_path / "recorded")  # consolidate's file records its checkpoint's layout
    units = [[[p.name for p in f.params] for f in read_manifest(d).flat_params] for d in (tmp_path / "recorded", path)]
    assert units[0] == units[1], "at the checkpoint's nesting"
    out = tmp_path / "w3"
    fsdp_optim.reshard(whole, 3, out, layout=path)
    training = read_manifest(out).training
    assert training is not None and len(training.files) == 3 and training.aliases == (("head.weight", "embed.weight"),)
    # The file keeps saved rank 0's extra, which every rank of the re-cut gets: only other ranks' extra may differ.
    changed = {r.param for r in fsdp_optim.diff(path, out).rows if r.status != "equal"}
    assert changed <= {"extra of rank 1", "extra of rank 2"}, changed
    assert fsdp_optim.verify(out).ok
    back, original = fsdp_optim.consolidate(out), fsdp_optim.consolidate(path)
    assert_identical(back["model"], original["model"], "model after the round trip")
    assert_identical(back["extra"], original["extra"], "extra after the round trip")
    assert_identical(back["optimizer"]["state"], original["optimizer"]["state"], "optimizer after the round trip")
    assert main(["reshard", str(whole), "--world-size", "2", "--layout", str(path), "-o", str(tmp_path / "w2")]) == 0
    assert "(weights included)" in capsys.readouterr().out


def test_load_checkpoint_reads_it(files) -> None:
    path, whole = files
    results = run_ranks(_load_all, 3, [str(path), str(whole)])
    for rank, (original, from_file) in enumerate(results):
        assert_identical(from_file["model"], original["model"], f"model at rank {rank}")
        if rank == 0:
            assert_identical(_content(from_file["optim"]), _content(original["optim"]), "optim")
        assert_identical(from_file["extra"], _extra(0), f"extra at rank {rank}: the file keeps rank 0's")


def test_load_checkpoint_refuses_a_file_that_is_not_whole(files, tmp_path) -> None:
    _, whole = files
    optim_only = tmp_path / "optim.pt"
    torch.save(fsdp_optim.consolidate(whole, with_model=False), optim_only)
    results: list[Any] = run_ranks(_load_all_or_error, 2, str(optim_only))
    assert all("expected a whole checkpoint" in r for r in results), results


def _load_all_or_error(rank: int, world_size: int, path: str) -> str:
    root = M.wrap(make_net(seed=123), "shallow")
    try:
        fsdp_optim.load_checkpoint(root, None, path)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_inspect_json_of_a_whole_checkpoint_and_its_file(files, capsys) -> None:
    from test_cli_outputs import check_inspect_json

    path, whole = files
    for given, kind in ((path, "sharded"), (whole, "whole_file")):
        assert main(["inspect", str(given), "--json"]) == 0
        report = check_inspect_json(capsys.readouterr().out, kind)
        model = report["model"]
        assert model["params"] == 18 and model["tied"] == [["head.weight", "embed.weight"]], model
        assert model["buffers"] == ["block1.seen"] and type(model["weight_bytes"]) is int, model
        assert report["params"] == 18 and report["world_size"] == 2 and report["steps"] == [3], report
