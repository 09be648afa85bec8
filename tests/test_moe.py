"""Mixture of experts: FSDP units over a process group of one rank (each rank its own expert).

The model mirrors fairscale's own ``MixtureOfExperts`` test model: shared layers are FSDP units over the
world, each rank's expert is an FSDP unit over a group holding only that rank, initialised differently
on every rank, so the experts' optimizer state differs per rank. At world sizes 2 and 4, after real
Adam steps on real gloo process groups, every rank's expert state must come back exactly:

- gather -> ``get_shard_from_optim_state_dict`` -> ``load_state_dict``;
- ``save_sharded_optim_state`` -> ``load_sharded_optim_state`` into a fresh optimizer;
- offline ``consolidate`` -> ``torch.save`` -> ``load_sharded_optim_state`` of the full file (scatter);

and a change of world size is refused, naming the per-rank unit (the experts cannot be mapped).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _checks import assert_identical, snapshot
from _dist import run_ranks
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim import (
    consolidate,
    load_sharded_optim_state,
    reshard,
    save_sharded_optim_state,
    to_named,
)
from fsdp_optim.formats.fullstate import PER_RANK_KEY

STEPS = 3


class MixtureOfExperts(nn.Module):
    """input -> shared (world) -> this rank's expert (own group) -> output (world); the root holds ``inp``."""

    def __init__(self, rank: int, expert_group: dist.ProcessGroup) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12)
        self.shared = FSDP(nn.Linear(12, 23))
        torch.manual_seed(42 + rank)  # "expert" parameters differ on every rank
        self.expert = FSDP(nn.Sequential(nn.Linear(23, 12), nn.LayerNorm(12)), process_group=expert_group)
        torch.manual_seed(0)
        self.out = FSDP(nn.Linear(12, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.expert(F.relu(self.shared(self.inp(x))))))


def _build(rank: int, world_size: int) -> tuple[FSDP, torch.optim.Optimizer]:
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group, in order
    root = FSDP(MixtureOfExperts(rank, groups[rank]))
    return root, torch.optim.Adam(root.parameters(), lr=0.01)


def _train(root: FSDP, optim: torch.optim.Optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        optim.zero_grad()
        F.mse_loss(root(torch.randn(4, 8, generator=g)), torch.randn(4, 8, generator=g)).backward()
        optim.step()


def _moe_job(rank: int, world_size: int, out: str) -> dict:
    root, optim = _build(rank, world_size)
    _train(root, optim, rank)
    own = snapshot(optim.state_dict())
    full = root.gather_full_optim_state_dict(optim, recipient_rank=None)
    only_recipient = root.gather_full_optim_state_dict(optim, recipient_rank=0)
    assert (only_recipient is None) == (rank != 0)

    # gather -> get_shard -> load
    shard = root.get_shard_from_optim_state_dict(full, optim=optim)
    assert_identical(shard["state"], own["state"], f"rank {rank}: get_shard")
    fresh = torch.optim.Adam(root.parameters(), lr=0.01)
    fresh.load_state_dict(shard)
    assert_identical(fresh.state_dict()["state"], own["state"], f"rank {rank}: loaded shard")

    # save -> load
    ckpt = os.path.join(out, "ckpt")
    save_sharded_optim_state(root, optim, ckpt)
    fresh = torch.optim.Adam(root.parameters(), lr=0.01)
    load_sharded_optim_state(root, fresh, ckpt)
    assert_identical(fresh.state_dict()["state"], own["state"], f"rank {rank}: save -> load")

    # consolidate -> full file -> load (scatter from rank 0)
    full_file = os.path.join(out, "full.pt")
    if rank == 0:
        consolidated = consolidate(ckpt)
        assert_identical(consolidated, full, "consolidate vs gather")
        torch.save(consolidated, full_file)
    dist.barrier()
    fresh = torch.optim.Adam(root.parameters(), lr=0.01)
    load_sharded_optim_state(root, fresh, full_file)
    assert_identical(fresh.state_dict()["state"], own["state"], f"rank {rank}: consolidate -> scatter")

    # the experts really differ per rank, and every rank's copy is in the dict
    refusals = {}
    if rank == 0:
        sections = full[PER_RANK_KEY]
        assert sorted(sections) == list(range(world_size)), sorted(sections)
        pid = next(iter(sections[0]))
        assert not torch.equal(sections[0][pid]["exp_avg"], sections[1][pid]["exp_avg"]), "experts identical"
        for name, call in {
            "reshard": lambda: reshard(ckpt, world_size + 1, os.path.join(out, "other")),
            "reshard_full": lambda: reshard(full, world_size // 2, os.path.join(out, "half"), layout=ckpt),
            "to_named": lambda: to_named(full),
        }.items():
            try:
                call()
                refusals[name] = None
            except ValueError as exc:
                refusals[name] = str(exc)
        refusals["wrote"] = sorted(os.listdir(out))
    return {"experts": full["fsdp_optim"].get("per_rank_units"), "refusals": refusals}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_gets_its_own_experts_back(world_size: int, tmp_path) -> None:
    results = run_ranks(_moe_job, world_size, str(tmp_path))
    assert results[0]["experts"] == ["expert"]
    refusals = results[0]["refusals"]
    for name in ("reshard", "reshard_full"):
        message = refusals[name]
        assert message is not None, f"{name} at another world size was not refused"
        assert "FSDP unit 'expert'" in message and "per-rank" in message and f"world size {world_size}" in message, message
    assert refusals["to_named"] is not None and PER_RANK_KEY in refusals["to_named"]
    assert refusals["wrote"] == ["ckpt", "full.pt"], refusals["wrote"]  # refused reshards wrote nothing
