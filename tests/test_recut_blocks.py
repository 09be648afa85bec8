"""Offline reshard of a format-3 checkpoint by block re-cut (``formats/sharded/recut.py``) writes exactly what
the unit-by-unit path writes: the same shards, zero padding, for every pair of world sizes tried, with units
that are not sharded, empty units, two dtypes, and groups of output ranks small enough to split the work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _checks import assert_identical
from safetensors.torch import load_file

from fsdp_optim import consolidate, reshard
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.formats.fullstate import FORMAT_KEY, FORMAT_VERSION
from fsdp_optim.formats.sharded import recut
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.offline import cuts


def _layout(world_size: int) -> ModelLayout:
    """Six units: sizes that pad differently, one empty, one not sharded, one of float64."""
    sizes = [(37, torch.float32, True), (5, torch.float32, True), (0, torch.float32, True), (64, torch.float64, True),
             (9, torch.float32, False), (130, torch.float32, True)]  # fmt: skip
    flats, names = [], []
    for u, (numel, dtype, sharded) in enumerate(sizes):
        w, b = ParamSpec(f"u{u}.w", (numel,), 0), ParamSpec(f"u{u}.b", (3,), numel)
        flats.append(FlatParamLayout(f"u{u}", (w, b), world_size if sharded else 1, 0, dtype, True))
        names += [w.name, b.name]
    return ModelLayout(tuple(flats), tuple(names), world_size, 0)


def _full(lay: ModelLayout) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    dtypes = {p.name: f.dtype for f in lay.flat_params for p in f.params}
    shapes = {p.name: p.shape for f in lay.flat_params for p in f.params}
    state = {
        i: {"step": torch.tensor(4.0), "exp_avg": torch.randn(shapes[n], generator=g).to(dtypes[n]),
            "exp_avg_sq": torch.rand(shapes[n], generator=g).to(dtypes[n])}
        for i, n in enumerate(lay.param_order)
    }  # fmt: skip
    meta = {"version": FORMAT_VERSION, "optimizer": "Adam", "world_size": lay.world_size, "scalar_keys": ["step"]}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(len(lay.param_order)))}]
    return {"state": state, "param_groups": groups, "param_names": dict(enumerate(lay.param_order)), FORMAT_KEY: meta}


def _tensors(directory: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(directory / f.file)) for f in sorted(read_manifest(directory).files, key=lambda f: f.rank)]


def _source(tmp_path: Path, world_size: int) -> dict[str, Any]:
    """A checkpoint of the six units at ``world_size`` in ``tmp_path / "src"``; returns the full dict it holds."""
    full = _full(_layout(4))
    reshard(full, world_size, tmp_path / "src", layout=_layout(4))
    return full


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Calls of ``recut.<name>`` (each appends 1), the function still doing its work."""
    used: list[int] = []
    real = getattr(recut, name)
    monkeypatch.setattr(recut, name, lambda *a: used.append(1) or real(*a))
    return used


@pytest.mark.parametrize("source_size", [1, 3, 8])
def test_block_recut_writes_what_the_unit_by_unit_path_writes(
    tmp_path: Path, source_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = _source(tmp_path, source_size)
    used = _count(monkeypatch, "recut_groups")
    for world_size in (1, 2, 3, 5, 8, 13):
        monkeypatch.setattr(cuts, "BLOCK_BYTES", 256 << 20)
        reshard(tmp_path / "src", world_size, tmp_path / f"blocks{world_size}")
        monkeypatch.setattr(cuts, "BLOCK_BYTES", 0)  # no group fits: unit by unit
        reshard(tmp_path / "src", world_size, tmp_path / f"units{world_size}")
        blocks, units = _tensors(tmp_path / f"blocks{world_size}"), _tensors(tmp_path / f"units{world_size}")
        assert len(blocks) == world_size and all(a.keys() == b.keys() for a, b in zip(blocks, units))
        for rank, (a, b) in enumerate(zip(blocks, units)):
            for name in a:
                assert torch.equal(a[name], b[name]), (source_size, world_size, rank, name)
        assert_identical(consolidate(tmp_path / f"blocks{world_size}")["state"], full["state"], f"-> {world_size}")
    assert len(used) == 6, used  # the block path ran each time BLOCK_BYTES allowed it


def test_small_groups_split_the_output_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _full(_layout(4))
    reshard(full, 7, tmp_path / "src", layout=_layout(4))
    with open_checkpoint(tmp_path / "src", lazy=False) as ckpt:
        target = read_manifest(tmp_path / "src").with_world_size(5)
        blocks = recut.Recut.of(ckpt, target)
        per_rank = blocks.rank_bytes(blocks.target_sizes)
        assert recut.group_size(blocks, ckpt.layout[1], 10 * per_rank) in (1, 2, 4)
    monkeypatch.setattr(cuts, "BLOCK_BYTES", 10 * per_rank)  # a few output ranks per group
    reshard(tmp_path / "src", 5, tmp_path / "out")
    assert_identical(consolidate(tmp_path / "out")["state"], full["state"], "groups of output ranks")


@pytest.mark.parametrize("source_size", [1, 3, 8])
def test_consolidate_by_whole_rank_files_equals_unit_by_unit(
    tmp_path: Path, source_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = _source(tmp_path, source_size)
    used = _count(monkeypatch, "full_flats")
    blocks = consolidate(tmp_path / "src")
    monkeypatch.setattr(cuts, "BLOCK_BYTES", 0)
    units = consolidate(tmp_path / "src")
    assert_identical(blocks, units, "blocks vs units")
    assert_identical(blocks["state"], full["state"], "blocks vs the full dict")
    assert len(used) == 2, used  # both calls asked; the second, with no budget, declined
