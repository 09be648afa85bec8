"""Export to PyTorch DCP (``fsdp_optim.to_dcp``), and FSDP2 resuming from it.

The jobs are tests/_fairseq.py's (shared with test_fairseq.py): "groups" shard sets written by fairscale FSDP at
world sizes 2 and 3 are exported offline; FSDP2 (``fully_shard``) at world sizes 1, 2 and 3 loads an export
with ``dcp.load`` + ``set_state_dict`` (the README recipe) and trains on: the result matches uninterrupted
unwrapped training. Every source kind (shard set, sharded checkpoint of ours, full dict file, full dict)
exports the same optimizer state, as one data file (``__0_0.distcp``) plus ``.metadata`` that ``dcp.load``
reads exactly; a refused export writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _fairseq as F
import _models as M
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _checks import assert_fsdp2_matches_plain, assert_identical
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.fairseq import OPTIM_KEY, ShardSet, consolidate_shards
from fsdp_optim.formats.dcp import DATA_FILE, METADATA

REL = 1e-4


def _skip_unused(name: str) -> bool:
    return name.startswith("unused.")  # fairscale's flat parameter gives it state; FSDP2 gives it none


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> F.Jobs:
    return F.run_jobs(tmp_path_factory.mktemp("fairseq"))


def _read(dcp_dir: Path, tmp_path: Path) -> dict:
    dcp_to_torch_save(dcp_dir, tmp_path / f"{dcp_dir.name}.pt")
    return torch.load(tmp_path / f"{dcp_dir.name}.pt", weights_only=False)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fsdp2_resumes_from_the_export(jobs, world_size) -> None:
    final = jobs.fsdp2[world_size]
    net, plain = F.reference("groups")
    assert_fsdp2_matches_plain(final, net, plain, names=M.plain_param_names(net), skip=_skip_unused, rel=REL)


def test_export_holds_weights_state_and_extras(jobs, tmp_path) -> None:
    prefix = jobs.prefix("groups", 2)
    back = _read(jobs.dcp_dirs[2], tmp_path)
    assert list(back) == ["model", "optimizer", "optimizer_extra"], list(back)
    assert back["optimizer_extra"] == {"loss_scale": F.LOSS_SCALE}
    consolidated = consolidate_shards(prefix, with_model=True)
    assert_identical(dict(sorted(back["model"].items())), dict(sorted(consolidated["model"].items())))
    named = fsdp_optim.to_named({k: v for k, v in consolidated[OPTIM_KEY].items() if k != "loss_scale"})
    assert_identical(dict(sorted(back["optimizer"]["state"].items())), dict(sorted(named["state"].items())))
    order = ShardSet(prefix).manifest.param_order
    for got, want in zip(back["optimizer"]["param_groups"], named["param_groups"], strict=True):
        assert got == {**want, "params": sorted(want["params"], key=order.index)}


def test_export_is_one_data_file_that_dcp_load_reads_exactly(jobs, tmp_path) -> None:
    directory = jobs.dcp_dirs[2]
    assert sorted(p.name for p in directory.iterdir()) == [METADATA, DATA_FILE]
    expected = _read(directory, tmp_path)  # checked against the shard set by the test above
    target = _zeros_like(expected)
    dcp.load(target, checkpoint_id=directory, no_dist=True)
    assert_identical(target, expected)


def _zeros_like(tree: Any) -> Any:
    """The same structure, tensors zeroed, other values replaced: what ``dcp.load`` must fill in."""
    if torch.is_tensor(tree):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {key: _zeros_like(value) for key, value in tree.items()}
    if isinstance(tree, list) and all(isinstance(v, dict) for v in tree):
        return [_zeros_like(v) for v in tree]
    return None


def test_every_source_exports_the_same_state(jobs, tmp_path) -> None:
    prefix = jobs.prefix("groups", 3)
    full = fsdp_optim.consolidate(prefix)
    fsdp_optim.reshard(full, 2, tmp_path / "ours", layout=ShardSet(prefix).manifest)
    torch.save(full, tmp_path / "full.pt")
    sources = {"ours": tmp_path / "ours", "file": tmp_path / "full.pt", "dict": full}
    expected = _read(jobs.dcp_dirs[3], tmp_path)["optimizer"]
    for name, source in sources.items():
        done = fsdp_optim.to_dcp(source, tmp_path / f"dcp-{name}")
        assert done.model_tensors == 0 and done.optim_params == len(expected["state"])
        back = _read(tmp_path / f"dcp-{name}", tmp_path)
        assert list(back) == ["optimizer"], name
        assert_identical(back["optimizer"], expected, name)


def test_refused_exports_write_nothing(jobs, tmp_path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="out_dir: .*taken exists and is not an empty directory"):
        fsdp_optim.to_dcp(jobs.prefix("groups", 2), taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    with pytest.raises(FileNotFoundError, match="no-such-set-shard<N>.pt"):
        fsdp_optim.to_dcp(tmp_path / "no-such-set-shard0.pt", tmp_path / "out")
    with pytest.raises(ValueError, match="expected a full optimizer state dict"):
        fsdp_optim.to_dcp({"state": {}}, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no output, no staging left


def test_cli_converts_every_source_to_dcp(jobs, tmp_path, capsys) -> None:
    prefix = jobs.prefix("groups", 2)
    full = fsdp_optim.consolidate(prefix)
    torch.save(full, tmp_path / "full.pt")
    fsdp_optim.reshard(full, 3, tmp_path / "ours", layout=ShardSet(prefix).manifest)
    for name in ("full.pt", "ours"):  # a DCP directory named like a torch file (dcp-full.pt) is a usage error
        out_dir = tmp_path / f"dcp-{Path(name).stem}"
        code = main(["convert", str(tmp_path / name), "--to", "dcp", "-o", str(out_dir)])
        out, err = capsys.readouterr()
        assert code == 0 and "model 0 tensors, optimizer state of 16 params" in out, err
        assert_identical(_read(out_dir, tmp_path)["optimizer"], _read(jobs.dcp_dirs[2], tmp_path)["optimizer"])
