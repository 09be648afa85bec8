"""The full optimizer state by parameter name in one safetensors file (``to_safetensors`` / ``load_full_state``).

A real job (fairscale FSDP, world size 2, gloo) trains Adam, AdamW and SGD with momentum over two param groups,
gathers the full dict and saves a sharded checkpoint. Offline, every source kind (the dict, its file, the
sharded directory, the CLI) becomes a safetensors file that ``safetensors.safe_open`` reads as ``<name>/<key>``
tensors and that ``load_full_state`` turns back into the gathered dict, bit for bit. Jobs at world sizes 2 and
3 cut their shards from the file (``get_shard_from_optim_state_dict``, ``scatter_full_optim_state``) exactly as
from the dict. Corrupted bytes and crafted headers are refused by name; hyperparameters round-trip exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from safetensors import safe_open

import fsdp_optim
from fsdp_optim import load_full_state, save_sharded_optim_state, to_safetensors
from fsdp_optim.cli import main
from fsdp_optim.core.flatten import same_scalar
from fsdp_optim.formats.named_safetensors.document import FormatError
from fsdp_optim.formats.named_safetensors.document import read_named_header as read_header
from fsdp_optim.formats.named_safetensors.reader import ChecksumError, NamedSafetensors

OPTIMIZERS = ["adam", "adamw", "sgd_momentum"]
STEPS = 3


def _train(rank: int, world_size: int, out: str) -> dict:
    fulls = {}
    for name in OPTIMIZERS:
        root = M.wrap(M.make_net(), "deep")
        optim = M.OPTIMIZERS[name](M.fsdp_param_groups(root))
        for step in range(STEPS):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        full = fsdp_optim.gather_full_optim_state_dict(root, optim)
        save_sharded_optim_state(root, optim, os.path.join(out, f"{name}.ckpt"))
        if rank == 0:
            torch.save(full, os.path.join(out, f"{name}.full.pt"))
            fulls[name] = full
    return fulls


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("named")
    fulls = run_ranks(_train, 2, str(out))[0]
    for name in OPTIMIZERS:
        to_safetensors(out / f"{name}.full.pt", out / f"{name}.safetensors")
    return out, fulls


def _without_layout(full: dict, kind: str) -> dict:
    """``full`` without the FSDP layout a file made of a sharded checkpoint records (for reshard), checked there."""
    layout = full["fsdp_optim"].pop("layout", None)
    assert (layout is not None) == (kind == "sharded"), f"{kind}: the checkpoint's layout recorded"
    return full


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_source_round_trips_bit_for_bit(trained, optimizer, tmp_path) -> None:
    out, fulls = trained
    full = fulls[optimizer]
    assert len(full["param_groups"]) == 2 and full["fsdp_optim"]["world_size"] == 2
    assert_identical(load_full_state(out / f"{optimizer}.safetensors"), full, "from the full dict file")
    sources = {"dict": full, "sharded": out / f"{optimizer}.ckpt", "safetensors": out / f"{optimizer}.safetensors"}
    for kind, source in sources.items():
        to_safetensors(source, tmp_path / f"{kind}.safetensors", max_mapped_bytes=1)
        assert_identical(_without_layout(load_full_state(tmp_path / f"{kind}.safetensors"), kind), full, kind)
    assert main(["convert", str(out / f"{optimizer}.ckpt"), "--to", "safetensors", "-o", str(tmp_path / "cli.st")]) == 0
    assert_identical(_without_layout(load_full_state(tmp_path / "cli.st"), "sharded"), full, "cli")
    # The other offline functions take the file as a source too (one way in).
    assert_identical(fsdp_optim.consolidate(out / f"{optimizer}.safetensors"), full, "consolidate")
    fsdp_optim.reshard(out / f"{optimizer}.safetensors", 3, tmp_path / "ws3", layout=out / f"{optimizer}.ckpt")
    resharded = fsdp_optim.consolidate(tmp_path / "ws3")
    assert resharded["fsdp_optim"]["world_size"] == 3
    assert_identical({**resharded, "fsdp_optim": full["fsdp_optim"]}, full, "resharded")
    # load_full_state reads every other source kind too
    assert_identical(load_full_state(out / f"{optimizer}.ckpt"), full, "sharded")
    assert_identical(load_full_state(out / f"{optimizer}.full.pt"), full, "full file")


def test_safe_open_lists_named_tensors(trained) -> None:
    out, fulls = trained
    full = fulls["adam"]
    expected = {
        f"{full['param_names'][pid]}/{key}": value for pid, entries in full["state"].items() for key, value in entries.items()
    }
    with safe_open(str(out / "adam.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, value in expected.items():
            assert_identical(f.get_tensor(name), value, name)  # step is a 0-dim tensor, as gathered
        doc = json.loads(f.metadata()["fsdp_optim"])
    assert doc["format"] == "fsdp_optim.named_safetensors" and doc["optimizer"] == "Adam"
    assert doc["param_groups"][0]["hyperparams"]["betas"] == {"$tuple": [0.9, 0.999]}
    assert set(doc["tensors"]) == set(expected) and all(t["digest"].startswith("xxh3-128:") for t in doc["tensors"].values())


def _cut(rank: int, world_size: int, out: str, optimizer: str, nesting: str) -> bool:
    full = torch.load(os.path.join(out, f"{optimizer}.full.pt"), weights_only=True)
    path = os.path.join(out, f"{optimizer}.safetensors")
    root = M.wrap(M.make_net(), nesting)
    optim = M.OPTIMIZERS[optimizer](M.fsdp_param_groups(root))
    from_dict = fsdp_optim.get_shard_from_optim_state_dict(root, full, optim=optim)
    assert_identical(fsdp_optim.get_shard_from_optim_state_dict(root, path, optim=optim), from_dict, "get_shard")
    assert_identical(fsdp_optim.get_shard_from_optim_state_dict(root, path), from_dict, "get_shard without optim")
    fsdp_optim.scatter_full_optim_state(root, optim, path if rank == 0 else None)
    assert_identical(optim.state_dict(), from_dict, "scatter")
    return True


def test_which_files_a_live_model_takes_as_its_full_dict(trained) -> None:
    """formats/kinds.full_file_source (what get_shard / scatter take by path): a full dict file or a named
    safetensors file serve, each as the same source; any other kind is refused by its name."""
    from fsdp_optim.formats.kinds import full_file_source

    out, _ = trained
    from_file = full_file_source(out / "adam.full.pt", None, optimizer=None)  # (the layout numbers native dicts only)
    from_named = full_file_source(out / "adam.safetensors", None, optimizer=None)
    assert [f.params for f in from_file.flats] == [f.params for f in from_named.flats] and from_named.optimizer == "Adam"
    with pytest.raises(ValueError, match=r"adam\.ckpt: a sharded checkpoint, not a full dict; load a sharded checkpoint "
                       "with load_sharded_optim_state"):
        full_file_source(out / "adam.ckpt", None, optimizer=None)
    with pytest.raises(FileNotFoundError, match="no such file or directory; expected a sharded checkpoint directory"):
        full_file_source(out / "missing.pt", None, optimizer=None)


@pytest.mark.parametrize("world_size, nesting", [(2, "deep"), (3, "shallow")])
def test_get_shard_and_scatter_from_the_file_equal_the_dict(trained, world_size, nesting) -> None:
    out, _ = trained
    assert run_ranks(_cut, world_size, str(out), "adamw", nesting) == [True] * world_size


# ---------------------------------------------------------------------------------------------------
# Corruption and crafted files (no process group)


def _big_full() -> dict:
    """A full dict with a 1.6 MiB tensor (two checksum chunks) and a small one."""
    g = torch.Generator().manual_seed(0)
    state = {
        0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(600, 700, generator=g), "exp_avg_sq": torch.rand(600, 700, generator=g)},
        1: {"step": torch.tensor(4.0), "exp_avg": torch.randn(5, generator=g), "exp_avg_sq": torch.rand(5, generator=g)},
    }
    groups = [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "params": [0, 1]}]
    meta = {"version": 1, "optimizer": "Adam", "world_size": 1, "scalar_keys": ["step"]}
    return {"state": state, "param_groups": groups, "param_names": {0: "big.weight", 1: "small.bias"}, "fsdp_optim": meta}


def test_ranges_of_a_large_tensor_are_read_exactly(tmp_path) -> None:
    full = _big_full()
    to_safetensors(full, tmp_path / "big.st")
    flat = full["state"][0]["exp_avg"].reshape(-1)
    with NamedSafetensors(tmp_path / "big.st", max_mapped_bytes=0) as named:
        for lo, hi in [(0, 1), (5, 699), (699, 701), (700, 1400), (123, 400_001), (262_143, 262_145), (419_999, 420_000)]:
            assert torch.equal(named.read_flat("big.weight/exp_avg", lo, hi), flat[lo:hi]), (lo, hi)


def _corrupt(path: Path, tensor: str, at: int) -> None:
    """Flip one byte at byte ``at`` of ``tensor``'s data."""
    _, tensors = read_header(path)
    with open(path, "r+b") as f:
        f.seek(tensors[tensor].start + at)
        byte = f.read(1)
        f.seek(tensors[tensor].start + at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_corrupted_byte_is_refused_naming_the_tensor(tmp_path) -> None:
    full = _big_full()
    to_safetensors(full, tmp_path / "good.st")
    shutil.copy(tmp_path / "good.st", tmp_path / "bad.st")
    chunk = 1 << 20
    _corrupt(tmp_path / "bad.st", "big.weight/exp_avg_sq", chunk + 8)  # second chunk
    with pytest.raises(ChecksumError, match=r"tensor 'big.weight/exp_avg_sq' fails its checksum"):
        load_full_state(tmp_path / "bad.st")
    with NamedSafetensors(tmp_path / "bad.st") as named:  # a range inside the intact first chunk reads fine
        first = named.read_flat("big.weight/exp_avg_sq", 10, 1000)
        assert torch.equal(first, full["state"][0]["exp_avg_sq"].reshape(-1)[10:1000])
        with pytest.raises(ChecksumError, match=rf"bytes \[{chunk}, 1680000\)"):
            named.read_flat("big.weight/exp_avg_sq", chunk // 4 + 3, chunk // 4 + 9)
    shutil.copy(tmp_path / "good.st", tmp_path / "bad-small.st")
    _corrupt(tmp_path / "bad-small.st", "small.bias/exp_avg", 3)
    with pytest.raises(ChecksumError, match=r"tensor 'small.bias/exp_avg'"):
        load_full_state(tmp_path / "bad-small.st")
    _corrupt(tmp_path / "good.st", "small.bias/step", 0)  # scalars are checked when the file is opened
    with pytest.raises(ChecksumError, match=r"tensor 'small.bias/step'"):
        NamedSafetensors(tmp_path / "good.st")


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy ``src`` with its JSON header changed by ``edit(header)`` (the data unchanged)."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _set(path: list, value):
    def edit(header: dict) -> None:
        target = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value

    return edit


CRAFTED = {
    "huge shape": (_set(["small.bias/exp_avg", "shape"], [1 << 40]), r"shape \[1099511627776\] of F32 is 4398046511104 bytes"),
    "overlapping offsets": (_set(["small.bias/exp_avg", "data_offsets"], lambda o: [o[0] - 4, o[1] - 4]), "overlaps the tensor"),
    "wrong dtype": (_set(["small.bias/exp_avg", "dtype"], "F33"), r"dtype 'F33', expected one of"),
    "dtype of another size": (_set(["small.bias/exp_avg", "dtype"], "F64"), r"is 40 bytes but its offsets"),
    "metadata not JSON": (_set(["__metadata__", "fsdp_optim"], "{not json"), r"'fsdp_optim' metadata is not JSON"),
    "no metadata": (lambda h: h.pop("__metadata__"), "without fsdp_optim's 'fsdp_optim' metadata"),
    "newer version": (_set(["__metadata__", "fsdp_optim"], lambda t: t.replace('"version":2', '"version":9')), "format version 9"),
    "unknown tag": (_set(["__metadata__", "fsdp_optim"], lambda t: t.replace('{"$tuple":', '{"$set":')), "expected one of the tags"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_headers_are_refused(tmp_path, case) -> None:
    to_safetensors(_big_full(), tmp_path / "good.st")
    edit, message = CRAFTED[case]
    _rewrite(tmp_path / "good.st", tmp_path / "bad.st", edit)
    with pytest.raises(FormatError, match=message) as info:
        load_full_state(tmp_path / "bad.st")
    assert str(tmp_path / "bad.st") in str(info.value)


def test_a_version_1_file_reads_as_before(tmp_path) -> None:
    """Version 1 labelled a full tensor's entry "sharded"; version 2 writes "full" and reads both."""
    full = _big_full()
    to_safetensors(full, tmp_path / "new.st")
    meta = _set(["__metadata__", "fsdp_optim"], lambda t: t.replace('"version":2', '"version":1').replace(
        '"kind":"full"', '"kind":"sharded"'))  # fmt: skip
    _rewrite(tmp_path / "new.st", tmp_path / "old.st", meta)
    assert b'\\"kind\\":\\"sharded\\"' in (tmp_path / "old.st").read_bytes()[:1 << 16], "the old label was written"
    assert_identical(load_full_state(tmp_path / "old.st"), load_full_state(tmp_path / "new.st"))


def test_a_header_length_past_the_file_is_refused(tmp_path) -> None:
    to_safetensors(_big_full(), tmp_path / "good.st")
    raw = bytearray((tmp_path / "good.st").read_bytes())
    raw[:8] = struct.pack("<Q", (1 << 63) + 1)
    raw[8:9] = b"{"
    (tmp_path / "bad.st").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="header length 9223372036854775809 is past the file"):
        load_full_state(tmp_path / "bad.st")


def test_hyperparameters_and_scalars_round_trip_exactly(tmp_path) -> None:
    full = _big_full()
    full["param_groups"] = [
        {"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "amsgrad": False, "foreach": None,
         "nested": {"a": [1, (2.5, "x")], "b": -0.0}, "inf": math.inf, "nan": float("nan"), "big": (1 << 62) + 1,
         "name": "group \"zero\" é", "params": [0]},
        {"lr": torch.tensor(0.01, dtype=torch.float64), "betas": [0.8, 0.9], "params": [1], "param_names": ["small.bias"]},
    ]  # fmt: skip
    full["state"][0]["step"] = 4.0  # a Python float, as older torch keeps it
    full["state"][1]["step"] = torch.tensor(4, dtype=torch.int64)
    full["fsdp_optim"]["scalar_keys"] = ["step"]
    to_safetensors(full, tmp_path / "h.st")
    back = load_full_state(tmp_path / "h.st")
    for got, want in zip(back["param_groups"], full["param_groups"], strict=True):
        assert list(got) == list(want)
        for key in want:
            assert same_scalar(got[key], want[key]), key  # bit for bit: nan, -0.0, the tensor lr
            assert type(got[key]) is type(want[key]), key
    assert back["param_groups"][0]["nested"]["a"][1] == (2.5, "x") and math.copysign(1, back["param_groups"][0]["nested"]["b"]) == -1
    assert type(back["state"][0]["step"]) is float and back["state"][0]["step"] == 4.0
    assert_identical(back["state"][1]["step"], torch.tensor(4, dtype=torch.int64))
    assert_identical(back["state"][0]["exp_avg"], full["state"][0]["exp_avg"])


@pytest.mark.parametrize("value, found", [(object(), "a object, which a JSON manifest cannot hold"), ({1: 2}, "keyed by int")])
def test_hyperparameters_the_format_cannot_hold_are_refused(tmp_path, value, found) -> None:
    full = _big_full()
    full["param_groups"][0]["lr"] = value
    with pytest.raises(ValueError, match=rf"param group 0 hyperparameter 'lr'.*{found}"):
        to_safetensors(full, tmp_path / "x.st")
    assert list(tmp_path.iterdir()) == [], "a refused write leaves nothing behind"


def test_inspect_describes_the_file(tmp_path, capsys) -> None:
    to_safetensors(_big_full(), tmp_path / "i.st")
    assert main(["inspect", str(tmp_path / "i.st")]) == 0
    out = capsys.readouterr().out
    assert "format: named safetensors file" in out and "optimizer: Adam" in out and "params: 2 (2 with state)" in out
    assert "state keys: step (scalar), exp_avg (float32), exp_avg_sq (float32)" in out and "step: 4" in out


def test_verify_checks_every_chunk_of_a_named_safetensors_file(tmp_path, capsys) -> None:
    """verify reads our own safetensors file as one (not as a torch zip): the header, each chunk and each whole
    digest, naming a flipped byte's chunk."""
    path = tmp_path / "optim.safetensors"
    to_safetensors(_big_full(), path)
    report = fsdp_optim.verify(path)
    assert report.ok and report.problems == () and report.kind == "named safetensors file", report.lines()
    assert main(["verify", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "checksums match" in out and err == "", (out, err)
    before = path.read_bytes()
    _corrupt(path, "big.weight/exp_avg_sq", (1 << 20) + 8)  # the second chunk
    report = fsdp_optim.verify(path)
    assert not report.ok and len(report.problems) == 1, report.problems  # ok=False always says why
    assert str(path) in report.problems[0] and "big.weight/exp_avg_sq" in report.problems[0], report.problems
    assert "bytes [1048576, 1680000)" in report.problems[0], report.problems
    assert main(["verify", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "fails its checksum" in err and "zip" not in err, err
    assert path.read_bytes() != before and len(path.read_bytes()) == len(before)  # verify changed nothing


def test_convert_infers_the_target_from_the_extension_and_refuses_a_mismatch(tmp_path, capsys) -> None:
    """``convert SRC -o out.safetensors`` (no ``--to``) writes a safetensors file, never a torch pickle under a
    .safetensors name."""
    full = _big_full()
    to_safetensors(full, tmp_path / "src.st")
    assert main(["convert", str(tmp_path / "src.st"), "-o", str(tmp_path / "out.safetensors")]) == 0
    assert (tmp_path / "out.safetensors").read_bytes()[:2] != b"PK"  # not a torch (zip) file
    assert_identical(load_full_state(tmp_path / "out.safetensors"), full, "inferred safetensors")
    assert main(["convert", str(tmp_path / "src.st"), "-o", str(tmp_path / "out.pt")]) == 0
    assert_identical(torch.load(tmp_path / "out.pt", weights_only=True), full, "inferred full")
    capsys.readouterr()
    for to, name in [("full", "x.safetensors"), ("named", "x.safetensors"), ("safetensors", "x.pt"), ("dcp", "x.pth")]:
        with pytest.raises(SystemExit) as usage:
            main(["convert", str(tmp_path / "src.st"), "--to", to, "-o", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert usage.value.code == 2 and f"--to {to} was given" in err and name in err, (to, err)
        assert not (tmp_path / name).exists(), name
