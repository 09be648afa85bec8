"""A whole checkpoint (weights, buffers, optimizer, extra) offline: consolidated into one plain
``{"model", "optimizer", "extra"}`` dict (API and CLI) that an unwrapped model loads with ``strict=True`` and an
unwrapped optimizer trains on from; the checkpoints are written by 2 real fairscale ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from test_whole_state import REL, SAVE_AT, TOTAL, _extra, _save, make_net

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.disk.text import human_bytes


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A whole checkpoint of 2 ranks, with fairscale's own ``root.state_dict()`` and the gathered optimizer."""
    out = tmp_path_factory.mktemp("whole") / "step3"
    return out, run_ranks(_save, 2, str(out), False)[0]


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole checkpoint whose buffers differ across its 2 ranks (each rank's side file holds its own)."""
    out = tmp_path_factory.mktemp("whole") / "per_rank"
    run_ranks(_save, 2, str(out), True)
    return out


def _content(full: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in full.items() if k != "fsdp_optim"}


def _skip_unused(name: str) -> bool:
    return name.startswith("unused.")


def _check_consolidated(out: dict[str, Any], reference: dict[str, Any]) -> torch.nn.Module:
    assert list(out) == ["model", "optimizer", "extra"]
    net = make_net(seed=123)  # other values: the load must win
    net.load_state_dict(out["model"], strict=True)
    ours, theirs = net.state_dict(), reference["model"]
    assert sorted(ours) == sorted(theirs) == sorted(out["model"])
    for key in theirs:
        assert_identical(ours[key], theirs[key], key)
    assert out["model"]["head.weight"] is out["model"]["embed.weight"] or (
        out["model"]["head.weight"].untyped_storage().data_ptr()
        == out["model"]["embed.weight"].untyped_storage().data_ptr()
    ), "a tied parameter is one tensor under both names"
    assert_identical(_content(out["optimizer"]), _content(reference["optim"]), "optimizer")
    assert_identical(out["extra"], _extra(0), "extra")
    return net


def test_consolidate_whole_loads_strict_and_trains_on(saved) -> None:
    path, reference = saved
    out = fsdp_optim.consolidate(path)
    net = _check_consolidated(out, reference)
    optim = M.OPTIMIZERS["adam"](M.plain_param_groups(net))
    optim.load_state_dict(out["optimizer"])  # ids run group by group, as the plain optimizer numbers them
    for step in range(SAVE_AT, TOTAL):
        M.train_step(net, optim, *M.batch(step))
    want, plain = M.train_plain("adam", range(TOTAL), net=make_net())
    for key, value in want.state_dict().items():
        if key.endswith("seen"):  # changed by the loop before saving: the saved value, not the initial one
            assert_identical(net.state_dict()[key], value + 10.0, key)
        elif not _skip_unused(key):
            atol = REL * float(value.abs().max())
            torch.testing.assert_close(net.state_dict()[key], value, rtol=REL, atol=atol)
    got, expected = optim.state_dict(), plain.state_dict()
    names = M.plain_param_names(net)
    for pid, entries in expected["state"].items():
        for key, value in entries.items() if not _skip_unused(names[pid]) else ():
            torch.testing.assert_close(got["state"][pid][key], value, rtol=REL, atol=REL * float(value.abs().max()))


def test_consolidate_whole_cli_streams_one_file(saved, tmp_path) -> None:
    path, reference = saved
    target = tmp_path / "whole.pt"
    assert main(["consolidate", str(path), "-o", str(target)]) == 0
    out = torch.load(target, weights_only=True)
    _check_consolidated(out, reference)
    assert main(["consolidate", str(path), "-o", str(tmp_path / "optim.pt"), "--no-model"]) == 0
    written = torch.load(tmp_path / "optim.pt", weights_only=True)
    assert written["fsdp_optim"].pop("layout")["world_size"] == 2, "the checkpoint's layout, recorded for reshard"
    assert_identical(written, fsdp_optim.consolidate(path, with_model=False))
    before = target.read_bytes()
    assert main(["consolidate", str(path), "-o", str(target), "--rank", "1"]) == 1, "an existing file is refused"
    assert target.read_bytes() == before
    assert main(["consolidate", str(path), "-o", str(target), "--rank", "1", "--overwrite"]) == 0
    assert torch.load(target, weights_only=True)["extra"]["rank"] == 1


def test_consolidate_per_rank_buffers_needs_a_rank(per_rank, tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match=r"buffers differed across its 2 ranks.*rank="):
        fsdp_optim.consolidate(per_rank)
    assert main(["consolidate", str(per_rank), "-o", str(tmp_path / "x.pt")]) == 1
    assert "--rank" in capsys.readouterr().err and not (tmp_path / "x.pt").exists()
    for rank in (0, 1):
        out = fsdp_optim.consolidate(per_rank, rank=rank)
        assert_identical(out["extra"], _extra(rank), "extra")
        assert torch.equal(out["model"]["block1.seen"], torch.arange(4.0) + 10.0 + rank)
    with pytest.raises(ValueError, match=r"rank: .* ranks 0\.\.1, found rank=2"):
        fsdp_optim.consolidate(per_rank, rank=2)


def _load_all(rank: int, world_size: int, paths: list[str]) -> list[dict[str, Any]]:
    """Each checkpoint loaded into a fresh model and optimizer at this world size: their full state and extra."""
    out = []
    for path in paths:
        root = M.wrap(make_net(seed=123), "shallow")
        optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
        extra = fsdp_optim.load_checkpoint(root, optim, path)
        out.append({"model": root.state_dict(), "optim": root.gather_full_optim_state_dict(optim), "extra": extra})
    return out


def _save_from(
    rank: int, world_size: int, src: str, out: str, weights: dict[str, torch.Tensor], flip_rng: bool = False
) -> None:
    """``src`` loaded, its weights replaced by ``weights`` (fairscale's full load_state_dict), saved to ``out``;
    ``flip_rng``: rank 1's ``extra["rng"]`` with one byte changed."""
    root = M.wrap(make_net(seed=123), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    extra = fsdp_optim.load_checkpoint(root, optim, src)
    if flip_rng and rank == 1:
        extra["rng"] = extra["rng"].clone()
        extra["rng"][0] ^= 1
    root.load_state_dict(weights)
    fsdp_optim.save_checkpoint(root, optim, out, extra=extra)


def test_reshard_whole_keeps_weights_buffers_and_extra(saved, tmp_path, monkeypatch) -> None:
    from fsdp_optim.formats.sharded.reader import open_checkpoint
    from fsdp_optim.offline import cuts

    path, _ = saved
    blocks = tmp_path / "w3_blocks"
    fsdp_optim.reshard(path, 3, blocks)
    monkeypatch.setattr(cuts, "BLOCK_BYTES", 0)  # not even one output rank fits: unit by unit
    units = tmp_path / "w3_units"
    assert main(["reshard", str(path), "--world-size", "3", "-o", str(units)]) == 0
    with open_checkpoint(blocks, lazy=False) as a, open_checkpoint(units, lazy=False) as b:
        training = a.manifest.training
        assert training is not None and len(training.files) == 3 and not training.buffers_per_rank
        assert a.manifest.flat_params == b.manifest.flat_params and a.manifest.training.buffers == training.buffers
        assert any(e.key == "@param" for f in a.manifest.flat_params for e in f.state)
        for rank in range(3):
            assert_identical(a.load_rank(rank), b.load_rank(rank), f"rank {rank}")
    results = run_ranks(_load_all, 3, [str(path), str(blocks), str(units)])
    for rank, (original, *resharded) in enumerate(results):
        for other in resharded:
            assert_identical(other["model"], original["model"], f"model at rank {rank}")
            if rank == 0:  # the gathered optimizer comes back on rank 0
                assert_identical(_content(other["optim"]), _content(original["optim"]), "optim")
            assert_identical(other["extra"], _extra(rank % 2), f"extra at rank {rank}")


def test_reshard_refuses_per_rank_buffers_at_another_world_size(per_rank, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"buffers: .*differed across its 2 ranks.*world size 3 needs a choice"):
        fsdp_optim.reshard(per_rank, 3, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inspect_whole_says_model_buffers_and_extra(saved, capsys) -> None:
    path, _ = saved
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    params = len(list(make_net().parameters()))
    nbytes = sum(p.numel() * p.element_size() for p in make_net().parameters())
    assert "format: whole sharded checkpoint (model, optimizer, extra) (version 3)" in lines
    assert f"model: {params} params + 1 tied names (head.weight -> embed.weight), weights {human_bytes(nbytes)} (float32)" in lines
    assert "buffers: 1 (block1.seen) in rank 0's side file" in lines
    assert "extra of ranks 0..1: step, rank, rng, scheduler, $odd key" in lines
    assert not any("@param" in line for line in lines), "the optimizer's lines leave the weights out"
    assert main(["inspect", str(path), "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]  # before: extra_keys null where the text lists them
    assert model["extra_keys"] == ["step", "rank", "rng", "scheduler", "$odd key"], model


def test_verify_whole_checks_side_files(saved, tmp_path, capsys) -> None:
    import shutil

    from fsdp_optim.formats.sharded.locate import read_manifest

    path, _ = saved
    report = fsdp_optim.verify(path)
    training = read_manifest(path).training
    assert report.ok and len(report.files) == 1 + 2 + 2, report.lines()
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    side = copy / training.files[1].file
    data = bytearray(side.read_bytes())
    data[-1] ^= 0x01  # one bit of rank 1's extra
    side.write_bytes(bytes(data))
    report = fsdp_optim.verify(copy)
    assert not report.ok
    assert report.damaged() == [f"{side}: checksum mismatch (the side file is damaged or was modified)"]
    assert main(["verify", str(copy)]) == 1
    assert side.name in capsys.readouterr().err
    side.write_bytes(bytes(data[:-1]))
    assert main(["inspect", str(copy)]) == 1  # inspect checks sizes, side files included
    assert "bytes (the size the manifest records)" in capsys.readouterr().err


def _resume_fsdp2(rank: int, world_size: int, dcp_dir: str) -> dict[str, Any]:
    """FSDP2 (``fully_shard``) loads the DCP export by torchtitan's keys and trains on."""
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    net = make_net(seed=123)
    for unit in M.NESTINGS["deep"]:
        fully_shard(net.get_submodule(unit), mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = M.OPTIMIZERS["adam"](M.plain_param_groups(net))
    model_sd, optim_sd = get_state_dict(net, optim)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, optim, state["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    loaded = get_model_state_dict(net, options=full)
    for step in range(SAVE_AT, TOTAL):
        M.train_step(net, optim, *M.local_batch(step, rank, world_size))
    final = {"model": get_model_state_dict(net, options=full), "optim": get_optimizer_state_dict(net, optim, options=full)}
    return {"loaded": loaded, **final} if rank == 0 else {}


def test_convert_whole_to_dcp_resumes_fsdp2(saved, tmp_path, capsys) -> None:
    from _checks import assert_fsdp2_matches_plain

    path, reference = saved
    out = tmp_path / "dcp"
    assert main(["convert", str(path), "--to", "dcp", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "model 20 tensors" in said and "under 'optimizer'" in said, said  # 18 parameters, the tied name, the buffer
    assert main(["inspect", str(out), "--json"]) == 0  # before: "state of 0 params ... 0 param groups"
    details = json.loads(capsys.readouterr().out)["details"]
    written = int(said.split("optimizer state of ")[1].split(" ")[0])  # the parameters with state (16 of 18)
    assert written > 0 and (details["optimizer_params"], details["optimizer_key"]) == (written, "optimizer"), details
    assert details["param_groups"] == 2, details  # M.fsdp_param_groups: two groups
    final = run_ranks(_resume_fsdp2, 2, str(out))[0]
    for key, value in reference["model"].items():  # what fairscale's root.state_dict() held at save time
        assert_identical(final["loaded"][key], value, key)
    net, plain = M.train_plain("adam", range(TOTAL), net=make_net())
    skip = lambda name: _skip_unused(name) or name.endswith("seen")  # noqa: E731
    assert_fsdp2_matches_plain(final, net, plain, names=M.plain_param_names(net), skip=skip, rel=REL)
    assert torch.equal(final["model"]["block1.seen"], torch.arange(4.0) + 10.0)


@pytest.mark.parametrize("max_size", [None, "600B"], ids=["one_file", "index"])
def test_convert_whole_to_safetensors_loads_strict(saved, tmp_path, max_size) -> None:
    import json

    from safetensors.torch import load_file

    path, reference = saved
    out = tmp_path / "hf"
    argv = ["convert", str(path), "--to", "safetensors", "-o", str(out)]
    assert main(argv + (["--max-shard-size", max_size] if max_size else [])) == 0
    names = sorted(p.name for p in out.iterdir())
    if max_size is None:
        assert names == ["model.safetensors", "optimizer.safetensors"]
        state = load_file(out / "model.safetensors")
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 2 and names == sorted([*files, "model.safetensors.index.json", "optimizer.safetensors"])
        assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
        state = {}
        for name in files:
            part = load_file(out / name)
            assert sum(t.numel() * t.element_size() for t in part.values()) <= 600 or len(part) == 1, name
            assert all(index["weight_map"][k] == name for k in part)
            state.update(part)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    net = make_net(seed=123)
    net.load_state_dict(state, strict=True)
    for key, value in reference["model"].items():
        assert_identical(net.state_dict()[key], value, key)
    optim = fsdp_optim.load_full_state(out / "optimizer.safetensors")
    assert_identical(_content(optim), _content(reference["optim"]), "optimizer")


def test_convert_whole_refuses_what_does_not_apply(saved, tmp_path, capsys) -> None:
    path, _ = saved
    with pytest.raises(SystemExit) as usage:
        main(["convert", str(path), "--to", "dcp", "--max-shard-size", "1GB", "-o", str(tmp_path / "x")])
    assert usage.value.code == 2 and "--max-shard-size applies to --to safetensors" in capsys.readouterr().err
    for given in (["--to", "safetensors"], []):  # before: a directory named opt.safetensors
        with pytest.raises(SystemExit) as usage:
            main(["convert", str(path), *given, "-o", str(tmp_path / "opt.safetensors")])
        err = capsys.readouterr().err
        assert usage.value.code == 2 and "a whole checkpoint converts to a directory" in err, err
    assert not (tmp_path / "opt.safetensors").exists()
    with pytest.raises(ValueError, match="max_shard_size: expected bytes"):
        fsdp_optim.to_safetensors(path, tmp_path / "y", max_shard_size="lots")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def _only_extra_not_compared(report: Any, ranks: set[int]) -> bool:
    """Every part both sources hold is equal; the extra of ``ranks`` (one side only) is named as not compared."""
    skipped = {row.param for row in report.differences if row.status == "not compared"}
    return not report.equal and skipped == {f"extra of rank {r}" for r in ranks} and all(
        row.status == "not compared" for row in report.differences
    ) and not report.settings


def test_diff_and_deep_verify_see_the_weights_of_a_whole_checkpoint(saved, tmp_path) -> None:
    path, _ = saved
    resharded = tmp_path / "w3"
    fsdp_optim.reshard(path, 3, resharded)
    same = fsdp_optim.diff(path, resharded)
    assert any(row.key == "@param" for row in same.rows), "the weights are compared"
    assert _only_extra_not_compared(same, {2}), same.differences  # rank 2's extra: a saved 2 ranks
    full = fsdp_optim.consolidate(path)
    other = tmp_path / "other"
    bumped = {k: v.clone() for k, v in full["model"].items()}
    bumped["block1.0.weight"][0, 0] += 1.0  # one weight moved, the optimizer state as it was
    run_ranks(_save_from, 2, str(path), str(other), bumped)
    moved = [row for row in fsdp_optim.diff(path, other).rows if row.status != "equal"]
    assert {(row.param, row.key) for row in moved} == {("block1.0.weight", "@param")}, moved
    assert fsdp_optim.verify(path, deep=True).ok


def test_diff_and_deep_verify_see_buffers_and_extra(saved, tmp_path, capsys) -> None:
    path, _ = saved
    resharded = tmp_path / "w3"
    fsdp_optim.reshard(path, 3, resharded)
    same = fsdp_optim.diff(path, resharded)
    assert _only_extra_not_compared(same, {2}), same.differences
    assert ("block1.seen", "@buffer") in {(row.param, row.key) for row in same.rows}, "the buffers are compared"
    assert {row.param for row in same.rows} >= {"extra of rank 0", "extra of rank 1"}, "extra's tensors too"
    model = {k: v.clone() for k, v in fsdp_optim.consolidate(path)["model"].items()}
    model["block1.seen"][0] = math.inf  # one buffer value; weights and optimizer state as they were
    other = tmp_path / "other"
    run_ranks(_save_from, 2, str(path), str(other), model, True)
    report = fsdp_optim.diff(path, other)
    moved = {(row.param, row.key): row for row in report.differences}
    assert set(moved) == {("block1.seen", "@buffer"), ("extra of rank 1", "['rng']")}, moved
    assert moved[("block1.seen", "@buffer")].inf_b == 1 and report.summary.inf_b == 1
    code = main(["diff", str(path), str(other)])
    out = capsys.readouterr().out
    assert code == 1 and "block1.seen | @buffer | different" in out and "verdict: different: 2 of" in out, out
    findings = fsdp_optim.verify(other, deep=True).findings
    assert [str(f) for f in findings] == ["buffer 'block1.seen': 0 NaN and 1 Inf values of 4, expected every value finite"]
    assert main(["verify", str(other), "--deep"]) == 1
    out = capsys.readouterr().out
    assert "buffer 'block1.seen': 0 NaN and 1 Inf" in out, out
    assert "format: whole sharded checkpoint (model, optimizer, extra)" in out, "named as inspect names it"


def test_diff_of_a_whole_checkpoint_against_its_optimizer_alone_is_not_equal(saved, tmp_path, capsys) -> None:
    path, _ = saved
    optim = tmp_path / "optim.pt"
    torch.save(fsdp_optim.consolidate(path)["optimizer"], optim)
    report = fsdp_optim.diff(path, optim)
    assert not report.equal, "the weights and buffers the optimizer-only side lacks make it different"
    one_sided = {(row.key, row.status) for row in report.differences}
    assert one_sided == {("@param", "only in a"), ("@buffer", "only in a"), (None, "not compared")}, one_sided
    params = {row.param for row in report.rows if row.key == "@param"}
    assert len(params) == report.summary.params_a and all(
        row.same for row in report.rows if row.key not in ("@param", "@buffer", None)
    ), "the optimizer state itself is equal"
    code = main(["diff", str(path), str(optim)])
    out = capsys.readouterr().out
    assert code == 1 and "| @param | only in a |" in out and "on one side only" in out, out
    assert fsdp_optim.diff(optim, path).differences[0].status == "only in b"
