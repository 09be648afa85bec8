"""Every file the package writes read back whole: consolidate's one safetensors file of a whole checkpoint (weights,
tied names, buffers, optimizer state, extra) through consolidate, reshard, convert, inspect, diff, verify and
load_checkpoint at any world size; diff compares every part two sources share, with diff(1)'s exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from test_whole_state import _extra, make_net

import fsdp_optim
from fsdp_optim.cli import main


def _save_pair(rank: int, world_size: int, a: str, b: str) -> None:
    """A (trained) and B (the same, every parameter doubled): two whole checkpoints that differ in weights only."""
    root = M.wrap(make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(3):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, a, extra=_extra(rank))
    with torch.no_grad():
        for p in root.parameters():
            p.mul_(2)
    fsdp_optim.save_checkpoint(root, optim, b, extra=_extra(rank))
    shallow = M.wrap(make_net(), "shallow")  # another nesting of the same model, for --layout
    if rank == 0:
        fsdp_optim.save_layout(shallow, str(Path(a).parent / "shallow.layout"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Whole checkpoints A and B at W=2, and each consolidated into one safetensors file and a .pt file."""
    out = tmp_path_factory.mktemp("readback")
    run_ranks(_save_pair, 2, str(out / "A"), str(out / "B"))
    files = {"A": out / "A", "B": out / "B", "shallow": out / "shallow.layout"}
    for name in ("A", "B"):
        for suffix in ("safetensors", "pt"):
            path = out / f"{name.lower()}.{suffix}"
            assert main(["consolidate", str(out / name), "-o", str(path)]) == 0, path
            files[f"{name.lower()}.{suffix}"] = path
    return files


def _cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_diff_of_one_file_safetensors_compares_the_weights(pair: dict[str, Path], capsys: Any) -> None:
    """Two one-file safetensors whose weights differ are different (they were "equal (bitwise)": optimizer only)."""
    code, text, _ = _cli(capsys, "diff", pair["a.safetensors"], pair["b.safetensors"])
    assert code == 1 and "verdict: different" in text, text
    rows = fsdp_optim.diff(pair["a.safetensors"], pair["b.safetensors"]).differences
    assert {r.key for r in rows} == {"@param"}, "the weights, and only they, differ"
    code, text, _ = _cli(capsys, "diff", pair["a.safetensors"], pair["A"])
    report = fsdp_optim.diff(pair["a.safetensors"], pair["A"])
    assert {(r.param, r.status) for r in report.differences} == {("extra of rank 1", "not compared")}, text
    assert code == 1 and "verdict: not shown equal" in text, "every weight and buffer equal; rank 1's extra named"
    report = fsdp_optim.diff(pair["a.safetensors"], pair["a.pt"])
    assert report.equal and any(r.key == "@buffer" for r in report.rows), "buffers compared"
    assert any(r.param == "extra of rank 0" for r in report.rows), "extra's tensors compared"


def test_one_file_safetensors_consolidates_whole(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """consolidate one.safetensors -o x.pt writes the model, optimizer and extra (it wrote the optimizer alone)."""
    out = tmp_path / "x.pt"
    code, text, err = _cli(capsys, "consolidate", pair["a.safetensors"], "-o", out)
    assert code == 0, err
    assert_identical(torch.load(out, weights_only=True), torch.load(pair["a.pt"], weights_only=True))


def test_one_file_safetensors_reshards_converts_inspects(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    code, _, err = _cli(capsys, "reshard", pair["a.safetensors"], "--world-size", 3, "--layout", pair["A"],
                        "-o", tmp_path / "back")  # fmt: skip
    assert code == 0, err
    moved = {(r.param, r.key) for r in fsdp_optim.diff(tmp_path / "back", pair["A"]).differences}
    assert all(p.startswith("extra of rank") for p, _ in moved), f"weights, state and buffers kept: {moved}"
    code, text, err = _cli(capsys, "convert", pair["a.safetensors"], "--to", "dcp", "-o", tmp_path / "dcp")
    assert code == 0 and "model 0 tensors" not in text and "model " in text, text + err
    code, text, err = _cli(capsys, "inspect", pair["a.safetensors"], "--json")
    report = json.loads(text)
    assert code == 0 and report["model"] is not None and report["model"]["params"] > 0, text + err


def _load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    root = M.wrap(make_net(seed=123), "shallow")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    extra = fsdp_optim.load_checkpoint(root, optim, path)
    return {"model": root.state_dict(), "optim": root.gather_full_optim_state_dict(optim), "extra": extra}


@pytest.mark.parametrize("world_size", [1, 3])
def test_load_checkpoint_of_one_file_safetensors(pair: dict[str, Path], world_size: int) -> None:
    """load_checkpoint(model, optim, "one.safetensors") loads what the .pt gives (it said "not a zip file")."""
    got = run_ranks(_load, world_size, str(pair["a.safetensors"]))[0]
    want = run_ranks(_load, world_size, str(pair["a.pt"]))[0]
    assert_identical(got, want)


def test_consolidate_counts_extra_apart(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """The optimizer's tensors are counted without extra's (it said 121 for 120)."""
    from safetensors import safe_open

    out = tmp_path / "c.safetensors"
    code, text, _ = _cli(capsys, "consolidate", pair["A"], "-o", out)
    with safe_open(str(out), "pt") as f:
        optimizer = sum("/" in k and not k.startswith("extra/") for k in f.keys())  # noqa: SIM118
        model = len(json.loads(f.metadata()["fsdp_optim"])["whole"]["model"])
        optimizer -= sum("/" in k for k in json.loads(f.metadata()["fsdp_optim"])["whole"]["model"])
    assert code == 0 and f"optimizer {optimizer} tensors of" in text and f"model {model} tensors" in text, text


def test_hugging_face_layout_is_read_by_inspect_diff_verify(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """convert --to safetensors' directory (and its model.safetensors alone) is inspected, diffed and verified
    intact (verify called the model file damaged: no 'fsdp_optim' metadata)."""
    for shards in ((), ("--max-shard-size", "2KB")):
        hf = tmp_path / f"hf{len(shards)}"
        assert main(["convert", str(pair["A"]), "--to", "safetensors", "-o", str(hf), *shards]) == 0
        model = next(p for p in sorted(hf.iterdir()) if p.name.startswith("model") and p.suffix == ".safetensors")
        for path in (hf, model):
            code, text, err = _cli(capsys, "verify", path)
            assert code == 0 and "damaged" not in text, text + err
            code, text, err = _cli(capsys, "inspect", path)
            assert code == 0 and "Hugging Face" in text, text + err
        report = fsdp_optim.diff(hf, pair["A"])
        skipped = {(r.param, r.status) for r in report.differences}
        assert skipped == {("extra of rank 0", "not compared"), ("extra of rank 1", "not compared")}, skipped
        assert "keeps no extra" in report.differences[0].detail, report.differences[0]
        assert sum(r.key == "@param" and r.same for r in report.rows) > 0, "the weights compared"
        assert sum(r.key == "exp_avg" and r.same for r in report.rows) > 0, "the optimizer state compared"
    code, text, err = _cli(capsys, "diff", tmp_path / "hf0" / "model.safetensors", tmp_path / "hf0" / "model.safetensors")
    assert code == 0, text + err


def test_convert_says_what_it_leaves_out(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """convert --to full / named / safetensors of a whole checkpoint name the parts they do not write (they dropped
    the weights, buffers and extra without a word)."""
    for to in ("full", "named"):
        code, text, err = _cli(capsys, "convert", pair["A"], "--to", to, "-o", tmp_path / f"{to}.pt")
        assert code == 0 and "not written" in text and "weights, buffers and extra" in text, text + err
    code, text, err = _cli(capsys, "convert", pair["A"], "--to", "safetensors", "-o", tmp_path / "hf")
    assert code == 0 and "not written" in text and "extra" in text.split("not written")[1], text + err
    code, text, err = _cli(capsys, "convert", pair["a.safetensors"], "--to", "full", "-o", tmp_path / "f2.pt")
    assert code == 0 and "not written" in text, "the same for consolidate's file of a whole checkpoint"


def test_diff_exit_codes_follow_diff1(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """0 equal, 1 different (or a part not compared), 2 trouble (it exited 1 for bad input too)."""
    assert _cli(capsys, "diff", pair["a.pt"], pair["a.safetensors"])[0] == 0
    assert _cli(capsys, "diff", pair["A"], pair["B"])[0] == 1
    code, _, err = _cli(capsys, "diff", pair["A"], tmp_path / "missing")
    assert code == 2 and err.startswith("fsdp-optim: error: "), err


def test_diff_never_says_equal_over_a_part_it_skipped(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """extra's values (numbers, strings: not only its tensors) are compared; a saved rank's extra that one side
    lacks is a "not compared" row saying why, and the verdict is not "equal" (it said "equal" in both cases)."""
    whole = torch.load(pair["a.pt"], weights_only=True)
    torch.save({**whole, "extra": {**whole["extra"], "step": 99}}, tmp_path / "step99.pt")
    report = fsdp_optim.diff(pair["a.pt"], tmp_path / "step99.pt")
    assert [(r.param, r.key) for r in report.differences] == [("extra of rank 0", "values")], report.differences
    code, text, _ = _cli(capsys, "diff", pair["A"], pair["a.pt"])
    assert code == 1 and "extra of rank 1 | - | not compared" in text and "verdict: not shown equal" in text, text


def _units(path: Path) -> list[tuple[str, ...]]:
    from fsdp_optim.formats.sharded.locate import read_manifest

    return [tuple(p.name for p in f.params) for f in read_manifest(path).flat_params]


def test_consolidated_files_reshard_without_layout(pair: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    """A consolidated file (.pt or one safetensors, whole or optimizer-only) records its source's FSDP layout:
    reshard needs no --layout and cuts at the source's nesting; --layout still chooses another (it was refused)."""
    opt_pt, opt_st = tmp_path / "optim.pt", tmp_path / "optim.safetensors"
    for out in (opt_pt, opt_st):
        assert main(["consolidate", str(pair["A"]), "--no-model", "-o", str(out)]) == 0, out
    for source in (pair["a.pt"], pair["a.safetensors"], opt_pt, opt_st):
        target = tmp_path / f"r3-{source.name}"
        code, text, err = _cli(capsys, "reshard", source, "--world-size", 3, "-o", target)
        assert code == 0 and "3 rank files" in text, (source, text + err)
        assert _units(target) == _units(pair["A"]), f"{source}: the source's nesting"
        against = pair["A"] if source.stem == "a" else opt_pt
        moved = {r.param for r in fsdp_optim.diff(target, against).differences}  # the file kept rank 0's extra
        assert moved <= {"extra of rank 1", "extra of rank 2"}, (source, moved)
    other = tmp_path / "shallow"
    code, _, err = _cli(capsys, "reshard", pair["a.pt"], "--world-size", 2, "--layout", pair["shallow"], "-o", other)
    assert code == 0 and _units(other) == _units(pair["shallow"]) != _units(pair["A"]), err
