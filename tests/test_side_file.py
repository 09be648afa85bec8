"""A whole checkpoint's ``extra``: every value comes back with its type and bits, what JSON cannot hold is refused
naming where it is, and a side file is used only after the digest of all its bytes matches the manifest's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _checks import assert_identical

from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.side_file import MAX_DEPTH, decode_extra, encode_extra, read_side_file, write_side_file

EXTRA = {
    "step": 7,
    "lrs": (0.1, 0.2),
    "flags": [True, None, "x"],
    "inf": math.inf,
    "$dollar": {"$extra": 3},  # keys that look like our tags
    "rng": torch.Generator().manual_seed(1).get_state(),
    "scaler": {"scale": torch.tensor(65536.0), "mask": torch.tensor([True, False])},
    "bf16": torch.arange(3, dtype=torch.bfloat16),
}


def test_extra_round_trips_exactly() -> None:
    text, tensors = encode_extra(EXTRA)
    back = decode_extra(text, {f"extra/{k}": v for k, v in tensors.items()}, "test")
    assert_identical(back, EXTRA)
    nan = decode_extra(*(lambda t: (t[0], {f"extra/{k}": v for k, v in t[1].items()}))(encode_extra(math.nan)), "x")
    assert math.isnan(nan)


@pytest.mark.parametrize(
    "value, match",
    [({1: "a"}, r"extra: a dict key 1 \(int\)"), ({"a": [object()]}, r"extra\['a'\]\[0\]"), ({"s": {1, 2}}, "set")],
)
def test_what_json_cannot_hold_is_refused_naming_where(value: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        encode_extra(value)


def test_nesting_is_bounded() -> None:
    deep: object = 1
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError, match=f"more than {MAX_DEPTH} levels"):
        encode_extra(deep)


def test_a_side_file_is_used_only_when_its_digest_matches(tmp_path: Path) -> None:
    buffers = {"norm.running_mean": torch.arange(4.0)}
    record = write_side_file(tmp_path, save_id="ab" * 16, rank=0, world_size=1, buffers=buffers, extra=encode_extra(EXTRA))
    got_buffers, got_extra = read_side_file(where(tmp_path), record)
    assert_identical(got_buffers, buffers)
    assert_identical(got_extra, EXTRA)
    path = tmp_path / record.file
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_side_file(where(tmp_path), record)
