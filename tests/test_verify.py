"""Checking a checkpoint end to end, and the offline sharp edges, on files of one real job.

A world-size-2 job (gloo, our class, Adam over two param groups) writes a sharded checkpoint, the full
dict and a metaseq-style shard set; every test below damages or reads copies of them offline:

- ``fsdp_optim.verify`` / ``fsdp-optim verify``: presence, size and checksums of every file, one line per
  file, exit 1 naming what is wrong; ``inspect`` says "damaged" for a missing or truncated rank file;
- a truncated rank file is reported as truncated against the manifest's size, not as a legacy format;
- ``consolidate`` of a file that already is a full dict, a manifest whose ``param_order`` holds an int;
- a full dict in memory whose state tensors are views (transposed, strided, expanded, one tensor under two
  keys) is accepted and gives what its contiguous copy gives; the same dict in a file is still refused;
- ``consolidate`` of a shard set keeps the model unless ``--no-model``.
"""

from __future__ import annotations

import copy
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import _fairseq as F
import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from _forge import forge_manifest, forge_manifest_json, manifest_rank_file, to_format1

import fsdp_optim
from fsdp_optim.cli import main


def _job(rank: int, world_size: int, out: str) -> None:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    fsdp_optim.save_sharded_optim_state(root, optim, Path(out) / "ckpt")
    full = fsdp_optim.gather_full_optim_state_dict(root, optim)
    if rank == 0:
        torch.save(full, Path(out) / "full.pt")
    state = F.checkpoint_dict(root, optim, flavour="metaseq", num_updates=2, loss_scale=None)
    F.save_shard(state, Path(out) / "shards" / F.PREFIX, rank)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify")
    run_ranks(_job, 2, str(out))
    return out


def _run(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _copy(files: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(files / "ckpt", tmp_path / "ckpt"))


def _flip_tensor_byte(path: Path) -> None:
    """Flip one byte in the middle of the tensor data of a rank file (format 2: safetensors, the data after
    the 8-byte header length and the JSON header; format 1: the largest zip record of torch.save)."""
    raw = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":
        start = 8 + int.from_bytes(raw[:8], "little")
        raw[start + (len(raw) - start) // 2] ^= 0xFF
    else:
        with zipfile.ZipFile(path) as z:
            info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
        raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_verify_passes_intact_checkpoints_file_by_file(files, capsys) -> None:
    report = fsdp_optim.verify(files / "ckpt")
    assert report.ok and len(report.files) == 3, report.lines()  # the manifest and two rank files
    code, text, err = _run(capsys, "verify", files / "ckpt")
    assert code == 0 and err == "", err
    for f in report.files:
        assert f"{f.path.name}: ok" in text, text
    shards = fsdp_optim.verify(files / "shards" / F.PREFIX)
    assert shards.ok and len(shards.files) == 2, shards.lines()


@pytest.mark.parametrize("damage", ["truncated", "deleted", "flipped"])
def test_verify_names_each_damaged_file_and_exits_1(files, capsys, tmp_path, damage: str) -> None:
    ckpt = _copy(files, tmp_path)
    victim = manifest_rank_file(ckpt, 1)
    size = victim.stat().st_size
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: size // 2])
    elif damage == "deleted":
        victim.unlink()
    else:  # one byte of tensor data, far from the file's bookkeeping: only a checksum can tell
        _flip_tensor_byte(victim)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    report = fsdp_optim.verify(ckpt)
    assert not report.ok
    bad = [f for f in report.files if not f.ok]
    assert [f.path.name for f in bad] == [victim.name], report.lines()
    expected = {"truncated": f"{size // 2} of {size} bytes", "deleted": "missing", "flipped": "checksum"}[damage]
    assert expected in bad[0].detail, bad[0].detail
    code, text, err = _run(capsys, "verify", ckpt)
    assert code == 1 and victim.name in err and expected in err, (text, err)
    assert f"{manifest_rank_file(ckpt, 0).name}: ok" in text
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # verify changes nothing
    if damage != "flipped":  # inspect checks presence and sizes only
        code, text, err = _run(capsys, "inspect", ckpt)
        assert code == 1 and "damaged" in err and victim.name in err, (text, err)


def test_verify_names_a_truncated_shard_of_a_set(files, capsys, tmp_path) -> None:
    shards = Path(shutil.copytree(files / "shards", tmp_path / "shards"))
    victim = shards / f"{F.PREFIX}-shard1.pt"
    victim.write_bytes(victim.read_bytes()[:3000])
    code, text, err = _run(capsys, "verify", shards / F.PREFIX)
    assert code == 1 and victim.name in err, (text, err)
    assert f"{F.PREFIX}-shard0.pt: ok" in text, text


def test_a_truncated_rank_file_is_reported_as_truncated(files, tmp_path) -> None:
    ckpt = _copy(files, tmp_path)
    victim = manifest_rank_file(ckpt, 1)
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: size // 2])
    with pytest.raises(ValueError) as info:
        fsdp_optim.consolidate(ckpt)
    message = str(info.value)
    assert victim.name in message and "truncated" in message and f"{size // 2} of {size} bytes" in message, message
    assert "torch 1.6" not in message


def test_consolidating_a_full_dict_says_it_already_is_one(files, capsys, tmp_path) -> None:
    code, text, err = _run(capsys, "consolidate", files / "full.pt", "-o", tmp_path / "x.pt")
    assert code == 1 and "already a full dict" in err and "['" not in err, err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_a_param_order_holding_an_int_is_named(files, capsys, tmp_path, version: int) -> None:
    ckpt = _copy(files, tmp_path)
    if version == 1:
        to_format1(ckpt)
        forge_manifest(ckpt, lambda body: body["param_order"].__setitem__(0, 5))
    else:
        forge_manifest_json(ckpt, lambda body: body["param_order"].__setitem__(0, 5), raw=True)
    code, text, err = _run(capsys, "inspect", ckpt)
    assert code == 1 and "param_order" in err and "not supported between" not in err, err


def _views(full: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``full`` with state tensors replaced by views (transposed, strided, expanded, shared), and the same
    values as contiguous, unshared tensors."""
    views, plain = copy.deepcopy(full), copy.deepcopy(full)
    names = {name: pid for pid, name in full["param_names"].items()}
    transposed = views["state"][names["block1.0.weight"]]["exp_avg"]  # [7, 6]
    views["state"][names["block1.0.weight"]]["exp_avg"] = transposed.t().contiguous().t()
    strided = views["state"][names["block1.2.weight"]]["exp_avg_sq"]  # [6, 7]
    room = torch.zeros(*strided.shape, 2)
    room[..., 0] = strided
    views["state"][names["block1.2.weight"]]["exp_avg_sq"] = room[..., 0]  # a slice with a step of 2
    expanded = torch.full((1, 1), 0.25).expand(5, 5)  # stride 0
    views["state"][names["block2.inner.a.weight"]]["exp_avg"] = expanded
    plain["state"][names["block2.inner.a.weight"]]["exp_avg"] = expanded.contiguous()
    shared = views["state"][names["norm.weight"]]
    shared["exp_avg_sq"] = shared["exp_avg"]  # one tensor under two keys
    plain["state"][names["norm.weight"]]["exp_avg_sq"] = shared["exp_avg"].clone()
    assert not views["state"][names["block1.0.weight"]]["exp_avg"].is_contiguous()
    return views, plain


def test_views_in_memory_are_accepted_and_refused_in_files(files, tmp_path) -> None:
    full = torch.load(files / "full.pt", weights_only=True)
    views, plain = _views(full)
    before = copy.deepcopy(views)
    fsdp_optim.reshard(views, 2, tmp_path / "from-views", layout=files / "ckpt")
    fsdp_optim.reshard(plain, 2, tmp_path / "from-plain", layout=files / "ckpt")
    assert_identical(fsdp_optim.consolidate(tmp_path / "from-views"), fsdp_optim.consolidate(tmp_path / "from-plain"))
    named = fsdp_optim.to_named(views)
    assert_identical(named, fsdp_optim.to_named(plain) | {"state": named["state"]})
    for name, entries in fsdp_optim.to_named(plain)["state"].items():
        for key, value in entries.items():
            assert torch.equal(named["state"][name][key], value), (name, key)
    assert_identical(views, before)  # nothing changed
    torch.save(views, tmp_path / "views.pt")
    with pytest.raises(ValueError, match="referenced 2 times|shares memory|zero stride|overlap"):
        fsdp_optim.reshard(tmp_path / "views.pt", 2, tmp_path / "from-file", layout=files / "ckpt")
    assert not (tmp_path / "from-file").exists()


def test_consolidating_a_shard_set_keeps_the_model_unless_no_model(files, capsys, tmp_path) -> None:
    prefix = files / "shards" / F.PREFIX
    code, text, err = _run(capsys, "consolidate", prefix, "-o", tmp_path / "c.pt")
    assert code == 0, err
    kept = torch.load(tmp_path / "c.pt", weights_only=False)
    assert "model" in kept and "block1.0.weight" in kept["model"], sorted(kept)
    code, text, err = _run(capsys, "consolidate", prefix, "-o", tmp_path / "d.pt", "--no-model")
    assert code == 0, err
    assert "model" not in torch.load(tmp_path / "d.pt", weights_only=False)


def test_verify_knows_a_json_layout_file_and_refuses_a_lone_rank_file(files, tmp_path) -> None:
    """A JSON layout file is verified as one (its checksum, not as a torch zip); a lone safetensors rank file is
    refused, pointing at its checkpoint directory."""
    layout = tmp_path / "layout.json"
    shutil.copy(files / "ckpt" / "manifest.json", layout)  # a manifest is a layout file with rank files listed
    report = fsdp_optim.verify(layout)
    assert report.ok and report.kind == "layout file", report.lines()
    layout.write_text(layout.read_text().replace('"optimizer":"Adam"', '"optimizer":"Adan"', 1))
    report = fsdp_optim.verify(layout)
    assert not report.ok and report.problems and "layout.json" in report.problems[0], report.problems
    rank_file = manifest_rank_file(files / "ckpt", 0)
    with pytest.raises(ValueError, match="verify the checkpoint directory"):
        fsdp_optim.verify(rank_file)


def test_every_kind_of_input_has_its_class_and_verdict(files, tmp_path) -> None:
    """verify asks the input's class (offline/opened.class_of) how to check it: every kind has one, and a torch file
    whose content is not read yet is checked as one."""
    from fsdp_optim.formats.kinds import Kind
    from fsdp_optim.offline.opened import class_of
    from fsdp_optim.offline.opened.base import Opened

    assert class_of(None) is Opened
    assert all(class_of(kind).__name__.startswith("Opened") for kind in Kind)
    report = class_of(None).verify_files(files / "full.pt", ())
    assert report.ok and report.kind == "full dict", report.lines()  # its kind, as inspect names it
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="PyTorch DCP checkpoint, which records no checksums to verify"):
        fsdp_optim.verify(tmp_path / "dcp")
