"""A model with BatchNorm changes world size: its running statistics differ across ranks (each rank normalises its
own data), so a whole checkpoint holds them per rank, and a load at another world size (or an offline reshard to
one) needs a stated choice: ``buffers="rank0"`` (saved rank 0's) or ``"mean"`` (the mean across the saved ranks of
each floating-point buffer, rank 0's ``num_batches_tracked``). Without one both are refused, naming the option, and
nothing changes. A real nested FSDP model trained by 2 real ranks on different data, loaded by 1 and 3 real ranks;
every value checked against the buffers each rank held when it saved."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks
from torch import nn

import fsdp_optim
from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim.cli import main
from fsdp_optim.formats.sharded.reader import open_checkpoint

SAVED_WORLD = 2
STEPS = 3
STATS = ("block.1.running_mean", "block.1.running_var", "norm.running_mean", "norm.running_var")
COUNTS = ("block.1.num_batches_tracked", "norm.num_batches_tracked")


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.inp(x))))


def _wrapped(seed: int) -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = NormNet()
    net.block = FSDP(net.block)  # type: ignore[assignment]
    model = FSDP(net)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _buffers(model: FSDP) -> dict[str, torch.Tensor]:
    """The model's buffers by their unwrapped names (``state_dict()``: a collective)."""
    return {k: v.clone() for k, v in model.state_dict().items() if k in STATS + COUNTS}


def _trained(rank: int) -> tuple[FSDP, torch.optim.Optimizer]:
    """Trained on this rank's own data, so that the running statistics differ across ranks."""
    model, optim = _wrapped(0)
    for step in range(STEPS):
        torch.manual_seed(1000 * rank + step)
        model(torch.randn(5, 6) * (1 + rank) + rank).square().mean().backward()
        optim.step()
        optim.zero_grad()
    if rank == 1:  # counts differ too, as after uneven data: "mean" takes rank 0's
        for name, buffer in model.named_buffers():
            if name.endswith("num_batches_tracked"):
                buffer.add_(2)
    return model, optim


def _save(rank: int, world_size: int, out: str) -> dict[str, Any]:
    """Train, save; this rank's buffers and weights."""
    model, optim = _trained(rank)
    fsdp_optim.save_checkpoint(model, optim, out, extra={"rank": rank})
    state = model.state_dict()
    return {"buffers": _buffers(model), "weights": {k: v for k, v in state.items() if k not in STATS + COUNTS}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The checkpoint of 2 ranks, and what each rank held when it saved."""
    out = tmp_path_factory.mktemp("batchnorm") / "ckpt"
    return out, run_ranks(_save, SAVED_WORLD, str(out))


def _expected(held: list[dict[str, Any]], choice: str) -> dict[str, torch.Tensor]:
    first, second = held[0]["buffers"], held[1]["buffers"]
    if choice == "rank0":
        return first
    mean = {k: ((first[k].double() + second[k].double()) / 2).to(first[k].dtype) for k in STATS}
    return {k: mean[k] if k in STATS else first[k] for k in first}


def _load(rank: int, world_size: int, per_rank: str, shared: list[str]) -> dict[str, Any]:
    """At this world size: the per-rank checkpoint refused without a choice (nothing changed), then loaded with
    each choice; each checkpoint of ``shared`` (resharded offline with a choice) loaded without one."""
    model, optim = _wrapped(7)
    before = _buffers(model)
    try:
        fsdp_optim.load_checkpoint(model, optim, per_rank)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    out: dict[str, Any] = {"refused": refused, "unchanged": _buffers(model), "before": before}
    for choice in ("rank0", "mean"):
        extra = fsdp_optim.load_checkpoint(model, optim, per_rank, buffers=choice)
        state = model.state_dict()
        out[choice] = {"buffers": _buffers(model), "extra": extra, "weights": state if rank == 0 else None}
    for path in shared:
        fsdp_optim.load_checkpoint(model, optim, path)
        out[path] = _buffers(model)
    return out


def test_refused_without_a_choice_offline(saved, tmp_path, capsys) -> None:
    path, _ = saved
    with open_checkpoint(path, lazy=False) as ckpt:
        assert ckpt.manifest.training is not None and ckpt.manifest.training.buffers_per_rank
    with pytest.raises(ValueError, match=r"buffers: .*differed across its 2 ranks.*world size 3 needs a choice: "
                                         r"buffers='rank0' \(--buffers rank0\).*buffers='mean'"):  # fmt: skip
        fsdp_optim.reshard(path, 3, tmp_path / "w3")
    assert main(["reshard", str(path), "--world-size", "3", "-o", str(tmp_path / "w3")]) == 1
    assert "--buffers mean" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"buffers: expected one of 'refuse', 'rank0', 'mean', found 'average'"):
        fsdp_optim.reshard(path, 3, tmp_path / "w3", buffers="average")
    assert not (tmp_path / "w3").exists()


def test_reshard_at_the_saved_world_size_keeps_them_per_rank(saved, tmp_path) -> None:
    path, held = saved
    fsdp_optim.reshard(path, SAVED_WORLD, tmp_path / "w2", buffers="mean")
    with open_checkpoint(tmp_path / "w2", lazy=False) as ckpt:
        assert ckpt.manifest.training is not None and ckpt.manifest.training.buffers_per_rank
    for rank in range(SAVED_WORLD):
        got = fsdp_optim.consolidate(tmp_path / "w2", rank=rank)["model"]
        assert_identical({k: got[k] for k in held[rank]["buffers"]}, held[rank]["buffers"], f"rank {rank}")


@pytest.mark.parametrize("world_size", [1, 3])
def test_load_at_another_world_size_with_each_choice(saved, tmp_path, world_size: int) -> None:
    path, held = saved
    # Offline first: the API with "mean", the command line with rank0's; each output holds them once, shared.
    fsdp_optim.reshard(path, 3, tmp_path / "mean-w3", buffers="mean")
    assert main(["reshard", str(path), "--world-size", "1", "--buffers", "rank0", "-o", str(tmp_path / "rank0-w1")]) == 0
    shared = {"mean": str(tmp_path / "mean-w3"), "rank0": str(tmp_path / "rank0-w1")}
    for choice, out in shared.items():
        with open_checkpoint(out, lazy=False) as ckpt:
            assert ckpt.manifest.training is not None and not ckpt.manifest.training.buffers_per_rank, choice

    results = run_ranks(_load, world_size, str(path), list(shared.values()))
    for rank, result in enumerate(results):
        assert "buffers='rank0' (--buffers rank0)" in result["refused"], (rank, result["refused"])
        assert_identical(result["unchanged"], result["before"], f"rank {rank}: buffers after the refusal")
        for choice in ("rank0", "mean"):
            want = _expected(held, choice)
            assert_identical(result[choice]["buffers"], want, f"rank {rank}, buffers={choice!r}")
            assert result[choice]["extra"] == {"rank": rank % SAVED_WORLD}, result[choice]["extra"]
            assert_identical(result[shared[choice]], want, f"rank {rank}, resharded offline with {choice!r}")
    assert not torch.equal(held[0]["buffers"][STATS[0]], held[1]["buffers"][STATS[0]]), "the ranks' data differ"
    for choice in ("rank0", "mean"):
        weights = results[0][choice]["weights"]
        assert_identical({k: weights[k] for k in held[0]["weights"]}, held[0]["weights"], f"weights ({choice})")


def _manager(root: str, memory: str, node: str) -> fsdp_optim.CheckpointManager:
    return fsdp_optim.CheckpointManager(
        root, every=STEPS, keep=2, memory_every=1, replicas=1, memory_dir=memory, node=node
    )


def _save_managed(rank: int, world_size: int, root: str, memory: str) -> dict[str, torch.Tensor]:
    model, optim = _trained(rank)
    manager = _manager(root, memory, str(rank))  # a node per rank, each holding the other's replica
    manager.save(STEPS, model, optim, extra={"rank": rank})
    manager.wait()
    return _buffers(model)


def _restore(rank: int, world_size: int, root: str, memory: str, nodes: list[str]) -> dict[str, Any]:
    model, optim = _wrapped(7)
    manager = _manager(root, memory, nodes[rank])
    try:
        manager.restore(model, optim)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    manager.restore(model, optim, buffers="mean")
    return {"refused": refused, "from": manager.restored_from, "buffers": _buffers(model)}


@pytest.fixture
def memory() -> Iterator[Path]:
    path = Path("/dev/shm") / f"fsdp_optim-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_manager_restores_from_memory_at_another_world_size_with_a_choice(tmp_path, memory) -> None:
    root = tmp_path / "ckpt"
    held = run_ranks(_save_managed, SAVED_WORLD, str(root), str(memory))
    results = run_ranks(_restore, 3, str(root), str(memory), ["0", "0", "1"])
    want = _expected([{"buffers": b} for b in held], "mean")
    for rank, result in enumerate(results):
        assert "buffers='mean' (--buffers mean)" in result["refused"], (rank, result["refused"])
        assert result["from"] == "memory", result["from"]
        assert_identical(result["buffers"], want, f"rank {rank}")
