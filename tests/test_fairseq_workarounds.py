"""The fairseq and fairscale limits worked around (docs/migrating.md), each on its own; real fairseq checkpoints
showed all three (the real run is tests/test_fairseq_real.py):

1. fairscale's ``buffer_names`` lists non-persistent buffers (fairseq's sinusoidal positions), which are
   never in the saved weights: consolidate, to_dcp, reshard and inspect skip them, and the consolidated
   weights load strictly into the unwrapped model;
2. fairscale's ``load_local_state_dict`` before the first forward of a model with nested units (fairscale's
   own class, inside ``host_execution()``) loads, and the resumed job continues exactly;
3. fairseq's optimizer names map to the ``torch.optim`` class whose state they keep; shape-dependent ones
   (Adafactor, LAMB) are refused.

The shard sets come from real fairscale FSDP jobs at W=2, written as fairseq writes them.
"""

from __future__ import annotations

import math
from pathlib import Path

import _fairseq as F
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from torch import nn

import fsdp_optim
from fsdp_optim.core.elementwise import NotElementwiseError
from fsdp_optim.fairseq import ShardSet, consolidate_shards, reshard_shards
from fsdp_optim.formats.fairseq.optimizers import recorded_names, torch_optimizer

PREFIX = "checkpoint_2"
VOCAB, DIM, SEQ = 11, 6, 5


class Positions(nn.Module):
    """A stand-in for fairseq's transformer LM: sinusoidal positions as a NON-persistent buffer (as
    fairseq's SinusoidalPositionalEmbedding), a persistent buffer, two blocks that are nested FSDP units."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)
        angles = torch.arange(SEQ)[:, None] / 10 ** (torch.arange(DIM)[None] / DIM)
        self.register_buffer("positions", torch.sin(angles + math.pi / 4), persistent=False)
        self.register_buffer("version", torch.tensor([3.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def _job(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """fairscale's own FSDP (the caller is inside host_execution()): each block a unit, and the root."""
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    torch.manual_seed(seed)
    net, cpu = Positions(), torch.device("cpu")
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FairscaleFSDP(block, compute_device=cpu)
    root = FairscaleFSDP(net, compute_device=cpu)
    return root, torch.optim.Adam(root.parameters(), lr=0.01)


def _step(root: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
    optim.zero_grad()
    nn.functional.cross_entropy(root(tokens).reshape(-1, VOCAB), tokens.reshape(-1)).backward()
    optim.step()


def _local(root: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in root.local_state_dict().items()}


def _write(rank: int, world_size: int, out: Path) -> dict:
    """Train 2 steps, write the set (fairseq's keys); train a third. Returns the weights and shards."""
    with fsdp_optim.host_execution():
        root, optim = _job(seed=0)
        for step in range(2):
            _step(root, optim, step, rank)
        F.save_shard(F.checkpoint_dict(root, optim, flavour="fairseq", num_updates=2, loss_scale=None), out / PREFIX, rank)
        full = root.state_dict()  # the unwrapped model's: no non-persistent buffer
        _step(root, optim, 2, rank)
        return {"full": full if rank == 0 else None, "after": _local(root)}


def _resume(rank: int, world_size: int, out: Path) -> dict:
    """fairseq's resume: load this rank's file into a fresh model, before any forward or state_dict()."""
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fairscale_fsdp

    original = fairscale_fsdp.FullyShardedDataParallel.__dict__["_free_full_params"]
    shard = torch.load(out / f"{PREFIX}-shard{rank}.pt", map_location="cpu", weights_only=False)
    with fsdp_optim.host_execution():
        root, optim = _job(seed=1)  # another init: the load must win
        root.load_local_state_dict(shard["model"])
        optim.load_state_dict(shard["last_optimizer_state"])
        assert_identical(_local(root), dict(shard["model"]), f"rank {rank}: live shard after the load")
        _step(root, optim, 2, rank)
        after = _local(root)
    assert fairscale_fsdp.FullyShardedDataParallel.__dict__["_free_full_params"] is original, "not restored"
    return {"after": after}


def _sorted(state: dict) -> dict:
    return dict(sorted(state.items()))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("positions")
    results = run_ranks(_write, 2, out)
    return {"out": out, "full": results[0]["full"], "after": [r["after"] for r in results]}


def test_unsaved_buffers_are_skipped_everywhere(written, tmp_path, capsys) -> None:
    prefix = written["out"] / PREFIX
    shards = ShardSet(prefix)
    assert (shards.buffers, shards.unsaved_buffers) == (("version",), ("positions",))
    weights = consolidate_shards(prefix, with_model=True)["model"]
    assert_identical(_sorted(weights), _sorted(written["full"]), "consolidated weights")
    Positions().load_state_dict(weights, strict=True)  # every key, nothing missing
    done = fsdp_optim.to_dcp(prefix, tmp_path / "dcp")
    assert done.model_tensors == len(weights), done
    reshard_shards(prefix, 3, tmp_path / "w3")
    again = consolidate_shards(tmp_path / "w3" / PREFIX, with_model=True)["model"]
    assert_identical(_sorted(again), _sorted(weights), "consolidated after reshard 2 -> 3")
    from fsdp_optim.cli import main

    assert main(["inspect", str(prefix)]) == 0
    assert "buffers: version; not saved (non-persistent): positions" in capsys.readouterr().out


def test_nested_units_resume_before_the_first_forward(written) -> None:
    resumed = run_ranks(_resume, 2, written["out"])
    for rank, result in enumerate(resumed):
        assert_identical(result["after"], written["after"][rank], f"rank {rank}: a step after the resume")


@pytest.mark.parametrize(
    "recorded, name, expected",
    [
        ("FairseqAdam", "adam", "AdamW"),
        ("MetaseqAdam", "adam", "AdamW"),
        ("FP16Optimizer", "adam", "AdamW"),  # a wrapper: cfg names the optimizer inside
        ("MemoryEfficientFP16Optimizer", "adamax", "Adamax"),
        ("FairseqNAG", "nag", "SGD"),
        ("Adagrad", "adagrad", "Adagrad"),
        ("FairseqCompositeOptimizer", "composite", None),  # unknown: not labelled, not checked
        (None, None, None),
    ],
)
def test_fairseq_optimizer_names(recorded, name, expected) -> None:
    assert torch_optimizer(recorded, name, where="set") == expected


@pytest.mark.parametrize("recorded, name, label", [("FairseqAdafactor", "adafactor", "Adafactor"),
                                                   ("FP16Optimizer", "lamb", "LAMB")])  # fmt: skip
def test_shape_dependent_fairseq_optimizers_are_refused(recorded, name, label) -> None:
    with pytest.raises(NotElementwiseError, match=rf"set: the optimizer \({recorded} / {name}\): {label} .*shape"):
        torch_optimizer(recorded, name, where="set")


def _relabel(src: Path, dst: Path, recorded: str, name: str) -> Path:
    """A copy of the set whose files record another optimizer (as fairseq's trainer would have)."""
    dst.mkdir()
    for rank in range(2):
        state = torch.load(src / f"{PREFIX}-shard{rank}.pt", weights_only=False)
        state["optimizer_history"][-1]["optimizer_name"] = recorded
        state["cfg"]["optimizer"] = {"_name": name, "lr": [0.01]}
        torch.save(state, dst / f"{PREFIX}-shard{rank}.pt")
    return dst / PREFIX


def test_consolidation_labels_and_refuses_by_the_recorded_optimizer(written, tmp_path) -> None:
    assert recorded_names(torch.load(written["out"] / f"{PREFIX}-shard0.pt", weights_only=False)) == ("FairseqAdam", None)
    full = consolidate_shards(written["out"] / PREFIX)["last_optimizer_state"]
    assert full["fsdp_optim"]["optimizer"] == "AdamW"  # fairseq's Adam keeps AdamW's state
    assert consolidate_shards(written["out"] / PREFIX, optimizer="Adam")["last_optimizer_state"]["fsdp_optim"][
        "optimizer"] == "Adam"  # fmt: skip  # the caller's word wins
    wrapped = _relabel(written["out"], tmp_path / "fp16", "FP16Optimizer", "adam")
    assert consolidate_shards(wrapped)["last_optimizer_state"]["fsdp_optim"]["optimizer"] == "AdamW"
    refused = _relabel(written["out"], tmp_path / "adafactor", "FairseqAdafactor", "adafactor")
    with pytest.raises(NotElementwiseError, match=r"FairseqAdafactor / adafactor\): Adafactor"):
        consolidate_shards(refused)
    assert not (tmp_path / "out").exists()
    with pytest.raises(NotElementwiseError):
        reshard_shards(refused, 3, tmp_path / "out")
    assert not (tmp_path / "out").exists()
