"""Our sharded checkpoint on disk (format 3: ``manifest.json`` in exact JSON, safetensors rank files read by byte
range); the checkpoints of earlier formats are tests/test_old_formats.py.

- The manifest holds nothing per (unit, rank): its size grows by a file record per rank, whatever the units.
- Values of the JSON manifest round-trip with their types and bits (tensors of every dtype, non-finite and
  negative-zero floats, tuples, complex numbers, dicts whose keys look like tags); what JSON cannot hold is
  refused by name before anything is written.
- A rank file is a safetensors file any safetensors reader opens, holds nothing but the shards, and
  stays within ``payload x 1.02 + 4 KiB`` at 256 units; a re-cut read of part of a unit reads (hashes) at
  most 1.1x the bytes it copies, straight into the destination.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _checks import assert_identical
from safetensors import safe_open

from fsdp_optim import consolidate, reshard
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.records import GroupRecord, state_entries
from fsdp_optim.formats.sharded.json_values import from_json, to_json
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_from_json, manifest_to_json
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES
from fsdp_optim.formats.sharded.writer import write_all_or_nothing, write_shard_file

# --- exact JSON -------------------------------------------------------------------------------------------

_VALUES = [
    None, True, False, 0, -(2**80), 2.5, -0.0, 5e-324, float("inf"), float("-inf"), "β\n", [1, (2, 3)], (0.9, 0.999),
    complex(1.5, -0.0), {"$tuple": 1, "plain": [None]}, {"lr": (1, [2.0])},
]  # fmt: skip
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.uint8,
           torch.bool, torch.int8, torch.uint16]  # fmt: skip


@pytest.mark.parametrize("value", _VALUES, ids=repr)
def test_json_values_round_trip_with_their_types(value: object) -> None:
    import json

    back = from_json(json.loads(json.dumps(to_json(value, "v"), allow_nan=False)), "v")
    assert repr(back) == repr(value) and type(back) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, back) == math.copysign(1, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_json_tensors_round_trip_bit_exactly(dtype: torch.dtype) -> None:
    import json

    raw = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.uint8) if dtype == torch.bool else torch.arange(6, dtype=torch.uint8) * 37
    for t in (raw.view(dtype) if dtype.itemsize == 1 else torch.randn(6).to(dtype), torch.tensor(3.0).to(dtype)):
        t = t.reshape(2, -1) if t.dim() else t
        back = from_json(json.loads(json.dumps(to_json(t, "t"))), "t")
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.view(torch.uint8) if t.dim() else back.reshape(1).view(torch.uint8),
                           t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8))  # fmt: skip
    nan = torch.tensor(float("nan"))
    assert torch.equal(from_json(to_json(nan, "n"), "n").view(torch.int32), nan.view(torch.int32))


@pytest.mark.parametrize(
    "value, message",
    [
        ({1: 2}, "a dict keyed by int"),
        (torch.zeros(2000), "a tensor of 8000 bytes"),
        (object(), "a object, which a JSON manifest cannot hold exactly"),
        (torch.zeros(2, dtype=torch.complex64), "a torch.strided torch.complex64 tensor; a JSON manifest holds dense real"),
    ],
    ids=["int keys", "big tensor", "object", "complex tensor"],
)
def test_what_json_cannot_hold_is_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"hyperparams\\['x'\\]: {message}"):
        to_json({"x": value}, "hyperparams")


def _manifest(units: int, numel: int, *, hyper: dict | None = None) -> tuple[Manifest, dict[int, dict]]:
    """A world-size-1 manifest of ``units`` Adam units of ``numel`` float32 elements, and its state."""
    flats = tuple(FlatParamLayout(f"u{i}", (ParamSpec(f"u{i}.w", (numel,), 0),), 1, 0, torch.float32, True) for i in range(units))
    layout = ModelLayout(flats, tuple(f"u{i}.w" for i in range(units)), 1, 0)
    g = torch.Generator().manual_seed(0)
    state = {
        i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(numel, generator=g), "exp_avg_sq": torch.rand(numel, generator=g)}
        for i in range(units)
    }
    entries = {i: state_entries(flats[i], state[i]) for i in range(units)}
    groups = (GroupRecord(hyper or {"lr": torch.tensor(0.01), "betas": (0.9, 0.999), "eps": 1e-8}, tuple(range(units))),)
    return Manifest.from_layout(layout, save_id="ab" * 16, optimizer="Adam", state=entries, groups=groups), state


def test_manifest_json_round_trips_exactly() -> None:
    manifest, _ = _manifest(3, 10)
    back = manifest_from_json(manifest_to_json(manifest), source="m.json")
    assert back.to_dict().keys() == manifest.to_dict().keys()
    assert_identical(back.to_dict(), manifest.to_dict(), "manifest")  # the tensor lr, the tuple betas, step's dtype
    with pytest.raises(ValueError, match=r"m.json: checksum mismatch in the manifest"):
        manifest_from_json(manifest_to_json(manifest).replace(b'"numel":10', b'"numel":11'), source="m.json")


def _write(directory: Path, manifest: Manifest, state: dict[int, dict]) -> Path:
    def write(staging: Path) -> Manifest:
        record = write_shard_file(staging, state, save_id=manifest.save_id, rank=0, world_size=1)
        return Manifest(**{**manifest.__dict__, "files": (record,)})

    return write_all_or_nothing(directory, write, save_id=manifest.save_id, world_size=1)


def test_a_rank_file_is_a_safetensors_file_of_shards_only(tmp_path: Path) -> None:
    manifest, state = _manifest(256, 1024)  # 256 units: 2 MiB of shards, 768 scalars that stay in the manifest
    _write(tmp_path / "ckpt", manifest, state)
    record = read_manifest(tmp_path / "ckpt").files[0]
    payload = sum(v.numel() * v.element_size() for entries in state.values() for v in entries.values() if v.dim())
    assert record.nbytes <= payload * 1.02 + 4096, (record.nbytes, payload)
    with safe_open(str(tmp_path / "ckpt" / record.file), framework="pt") as f:
        assert list(f.keys()) == ["float32"] and f.metadata()["kind"] == "shard"
        data = f.get_tensor("float32")
    # Where each shard lies follows from the units alone: (flat, key) order, back to back.
    at = 0
    for i in range(256):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(data[at : at + 1024], state[i][key])
            at += 1024
    assert at == data.numel()
    assert_identical(consolidate(tmp_path / "ckpt")["state"][5], state[5], "unit 5")


def test_a_recut_read_reads_little_more_than_it_copies(tmp_path: Path) -> None:
    numel = 8 << 20  # one 32 MiB unit
    manifest, state = _manifest(1, numel)
    _write(tmp_path / "ckpt", manifest, state)
    start, stop = numel // 3 + 5, 2 * numel // 3 - 7  # a third of the unit, cut mid-chunk at both ends
    out = torch.empty(stop - start)
    with open_checkpoint(tmp_path / "ckpt", lazy=False) as ckpt:
        ckpt.copy_range(0, "exp_avg_sq", start, stop, out)
        read = ckpt._files[0].bytes_verified
    assert torch.equal(out, state[0]["exp_avg_sq"][start:stop])
    copied = out.numel() * 4
    assert copied < read <= copied + 2 * CHUNK_BYTES and read <= 1.1 * copied, (read, copied)


def test_the_manifest_grows_by_a_file_record_per_rank_not_per_unit_and_rank(tmp_path: Path) -> None:
    manifest, state = _manifest(64, 100)
    _write(tmp_path / "w1", manifest, state)
    sizes = {}
    for world_size in (4, 32):
        reshard(tmp_path / "w1", world_size, tmp_path / f"w{world_size}")
        sizes[world_size] = (tmp_path / f"w{world_size}" / MANIFEST_NAME).stat().st_size
        body = read_manifest(tmp_path / f"w{world_size}").to_dict()
        assert all("padding" not in f for f in body["flat_params"]) and all(len(f) == 4 for f in body["files"])
    per_rank = (sizes[32] - sizes[4]) / 28
    assert per_rank < 160, (sizes, per_rank)  # a file record each (name, checksum, size), nothing per unit


def test_stream_chunk_digests_equal_those_of_the_concatenation() -> None:
    from fsdp_optim.core.checksums import digest, stream_chunk_digests

    g = torch.Generator().manual_seed(1)
    for trial in range(100):
        sizes = torch.randint(0, 40, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
        parts = [torch.randn(n, generator=g) for n in sizes]
        per = int(torch.randint(1, 17, (1,), generator=g))
        whole = torch.cat(parts) if parts else torch.empty(0)
        expected = tuple(digest(whole[k : k + per]) for k in range(0, whole.numel(), per))
        assert stream_chunk_digests(parts, per, whole.numel()) == expected, (trial, sizes, per)


def test_nan_hyperparameters_keep_their_sign_and_payload_bits() -> None:
    import json
    import struct

    for bits in ("7ff8000000000000", "fff8000000000000", "7ff0000000000123", "fff4000000000001"):
        value = struct.unpack(">d", bytes.fromhex(bits))[0]
        back = from_json(json.loads(json.dumps(to_json({"lr": (value, 1.0)}, "v"), allow_nan=False)), "v")["lr"][0]
        assert struct.pack(">d", back).hex() == bits


def test_a_reformatted_format3_manifest_is_refused_on_its_bytes(tmp_path: Path) -> None:
    import json

    manifest, state = _manifest(2, 10)
    _write(tmp_path / "ckpt", manifest, state)
    path = tmp_path / "ckpt" / MANIFEST_NAME
    original = path.read_bytes()
    path.write_text(json.dumps(json.loads(original), indent=1))  # the same JSON values, other bytes
    with pytest.raises(ValueError, match="checked on its bytes as written .* reformatted or modified"):
        read_manifest(tmp_path / "ckpt")
    path.write_bytes(original.replace(b'"numel":10', b'"numel":11'))  # a value edited in place
    with pytest.raises(ValueError, match="checksum mismatch in the manifest"):
        read_manifest(tmp_path / "ckpt")
