"""The data stream at any world size: a job trains at 2 ranks with ResumableSampler and a real DataLoader, saves,
and resumes at 3 and at 1 rank keeping the global batch (12 = 2x6 = 3x4 = 1x12). The next 20 steps see exactly the
sample indices of an uninterrupted 2-rank run, global batch by global batch, across epoch boundaries (60 samples:
5 global batches an epoch), and their losses match within 1e-5 relative (no dropout). The same across a real SIGKILL,
CheckpointManager restoring the newest step. A checkpoint saved without data= has no data record, and a load that
asks for one is refused with nothing changed.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch.utils.data import DataLoader, Dataset

import fsdp_optim

LENGTH, BATCH, SEED, RESUMED_STEPS, REL = 60, 12, 5, 20, 1e-5


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Sample i: (tokens, targets, i), drawn from the seed and i alone (fsdp_optim.sample_generator)."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = fsdp_optim.sample_generator(SEED, index)
        return torch.randint(0, M.VOCAB, (M.SEQ,), generator=g), torch.randint(0, M.VOCAB, (M.SEQ,), generator=g), index


def _job(rank: int, world: int, root: str, load: str | None, stop: int, how: str) -> list[tuple[int, list[int], float]]:
    """Train until step ``stop``, resuming from ``load`` (a step directory, or the manager's root with ``how`` =
    "manager"); saving after steps N, M ("save:N,M") or every 2 steps with a CheckpointManager, killed by SIGKILL
    before step N's save ("kill:N"). Returns (step, this rank's sample indices, its local loss) per step."""
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    dataset = Tokens()
    sampler = fsdp_optim.ResumableSampler(dataset, world, rank, seed=SEED, global_batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler)
    manager = fsdp_optim.CheckpointManager(root, every=2, keep=2) if how.startswith(("manager", "kill")) else None
    step = 0
    if manager is not None:
        extra = manager.restore(model, optim, data=sampler)
        step = extra["step"] if extra is not None else 0
    elif load is not None:
        step = fsdp_optim.load_checkpoint(model, optim, load, data=sampler)["step"]
    seen = []
    while step < stop:
        sampler.set_epoch(sampler.epoch)  # the restored epoch keeps its position; the next starts at 0
        for tokens, targets, index in loader:
            step += 1
            optim.zero_grad()
            loss = F.cross_entropy(model(tokens).float().reshape(-1, M.VOCAB), targets.reshape(-1))
            loss.backward()
            optim.step()
            sampler.advance()
            seen.append((step, index.tolist(), loss.item()))
            if how.startswith("save:") and str(step) in how[5:].split(","):
                fsdp_optim.save_checkpoint(model, optim, Path(root) / f"step-{step}", extra={"step": step}, data=sampler)
            if how == f"kill:{step}":
                os.kill(os.getpid(), signal.SIGKILL)
            if manager is not None:
                manager.save(step, model, optim, extra={"step": step}, data=sampler)
            if step == stop:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    return seen


def _global(results: list[list[tuple[int, list[int], float]]]) -> dict[int, tuple[list[int], float]]:
    """Per step: the global batch's indices in window order (rank r's i-th sample is the window's (i*W + r)-th)
    and the global loss (the ranks' mean: equal per-rank batches)."""
    world, out = len(results), {}
    for records in zip(*results, strict=True):
        step = records[0][0]
        window = [records[r][1][i] for i in range(len(records[0][1])) for r in range(world)]
        out[step] = (window, sum(loss for _, _, loss in records) / world)
    return out


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, tuple[list[int], float]]:
    return _global(run_ranks(_job, 2, "", None, 26, "none"))  # steps 1..26


def _compare(name: str, resumed: dict[int, tuple[list[int], float]], reference: dict[int, Any], first: int) -> float:
    assert sorted(resumed) == list(range(first, first + RESUMED_STEPS)), f"{name}: steps {sorted(resumed)}"
    worst = 0.0
    for step, (window, loss) in resumed.items():
        assert window == reference[step][0], f"{name}, step {step}: saw {window}, expected {reference[step][0]}"
        worst = max(worst, abs(loss - reference[step][1]) / abs(reference[step][1]))
    print(f"{name}: largest relative loss difference over {RESUMED_STEPS} steps: {worst:.3g}")
    assert worst <= REL, f"{name}: loss differs by {worst:.3g} relative"
    return worst


def test_a_resume_at_3_and_1_ranks_sees_the_uninterrupted_global_batches(tmp_path: Path, uninterrupted: Any) -> None:
    assert [sorted(uninterrupted[s][0]) for s in range(1, 6)] != [sorted(uninterrupted[s][0]) for s in range(6, 11)]
    run_ranks(_job, 2, str(tmp_path), None, 5, "save:3,5")
    manifest = json.loads((tmp_path / "step-3" / "manifest.json").read_text())["body"]
    assert manifest["training"]["data"] == {"version": 1, "seed": SEED, "epoch": 0, "consumed": 36,
                                            "global_batch": BATCH, "dataset_length": LENGTH, "shuffle": True,
                                            "drop_last": False, "world_size": 2}, manifest["training"]  # fmt: skip
    for world in (3, 1):
        resumed = _global(run_ranks(_job, world, str(tmp_path), str(tmp_path / "step-3"), 23, "none"))
        _compare(f"2 -> {world} ranks", resumed, uninterrupted, 4)
    fsdp_optim.reshard(tmp_path / "step-3", 3, tmp_path / "offline-3")  # offline: the position is the job's, kept
    resharded = json.loads((tmp_path / "offline-3" / "manifest.json").read_text())["body"]
    assert resharded["world_size"] == 3 and resharded["training"]["data"] == manifest["training"]["data"], resharded
    # Saved at the epoch's end (its 5 global batches consumed): the resumed loop's next set_epoch starts epoch 1.
    resumed = _global(run_ranks(_job, 3, str(tmp_path), str(tmp_path / "step-5"), 25, "none"))
    _compare("2 -> 3 ranks, saved at the epoch's end", resumed, uninterrupted, 6)


def test_across_a_sigkill_the_manager_restores_the_newest_step_and_its_stream(tmp_path: Path, uninterrupted: Any) -> None:
    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_job, 2, str(tmp_path), None, 26, "kill:5")  # saved 2 and 4; killed after step 5's train step
    assert fsdp_optim.CheckpointManager(tmp_path, every=2, keep=2).latest() == 4
    resumed = _global(run_ranks(_job, 3, str(tmp_path), None, 24, "manager"))
    _compare("SIGKILL at 2 ranks, restored at 3", resumed, uninterrupted, 5)


def _plain(rank: int, world: int, root: str, load: bool) -> str:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    sampler = fsdp_optim.ResumableSampler(Tokens(), world, rank, global_batch_size=BATCH)
    if not load:
        fsdp_optim.save_checkpoint(model, optim, root, extra={"step": 1})
        return ""
    before = [p.detach().clone() for p in model.parameters()]
    try:
        fsdp_optim.load_checkpoint(model, optim, root, data=sampler)
    except ValueError as exc:
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), "a refusal changed"
        assert (sampler.epoch, sampler.consumed) == (0, 0), "a refused load moved the sampler"
        return str(exc)
    return "loaded"


def test_a_job_without_the_sampler_saves_no_data_record_and_a_load_asking_for_one_is_refused(tmp_path: Path) -> None:
    run_ranks(_plain, 2, str(tmp_path), False)
    training = json.loads((tmp_path / "manifest.json").read_text())["body"]["training"]
    assert sorted(training) == ["aliases", "buffers", "buffers_per_rank", "files", "version"], sorted(training)
    said = run_ranks(_plain, 2, str(tmp_path), True)
    assert all("records no data position (it was saved without data=)" in s for s in said), said


def _async_and_disagreeing(rank: int, world: int, root: str) -> tuple[str, int]:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    sampler = fsdp_optim.ResumableSampler(Tokens(), world, rank, global_batch_size=BATCH)
    sampler.advance(1 + rank)  # a rank's own count, not the job's
    try:
        fsdp_optim.save_checkpoint(model, optim, Path(root) / "disagree", data=sampler)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    sampler.consumed = 2 * BATCH
    fsdp_optim.async_save_checkpoint(model, optim, Path(root) / "async", data=sampler.state_dict()).wait()
    resumed = fsdp_optim.ResumableSampler(Tokens(), world, rank, global_batch_size=BATCH)
    fsdp_optim.load_checkpoint(model, optim, Path(root) / "async", data=resumed)
    return refused, resumed.consumed


def test_an_async_save_records_the_position_and_ranks_that_disagree_are_refused(tmp_path: Path) -> None:
    results = run_ranks(_async_and_disagreeing, 2, str(tmp_path))
    for refused, consumed in results:
        assert "every rank must save the same data position" in refused and "rank 1: {" in refused, refused
        assert consumed == 2 * BATCH, consumed
    assert not (tmp_path / "disagree" / "manifest.json").exists(), "a refused save wrote a manifest"


def _memory(rank: int, world: int, root: str, restore: bool) -> tuple[str | None, int, int]:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    manager = fsdp_optim.CheckpointManager(Path(root) / "durable", every=100, keep=1, memory_every=2, replicas=1,
                                           memory_dir=Path(root) / "memory", node=f"node{rank}")  # fmt: skip
    sampler = fsdp_optim.ResumableSampler(Tokens(), world, rank, global_batch_size=BATCH)
    if restore:
        manager.restore(model, optim, data=sampler)
        return manager.restored_from, sampler.epoch, sampler.consumed
    sampler.set_epoch(1)
    sampler.advance(2)
    manager.save(2, model, optim, data=sampler)
    manager.wait()
    return None, 1, 2 * BATCH


def test_the_memory_tier_keeps_the_position_too(tmp_path: Path) -> None:
    run_ranks(_memory, 2, str(tmp_path), False)
    restored = run_ranks(_memory, 3, str(tmp_path), True)
    assert all(r == ("memory", 1, 2 * BATCH) for r in restored), restored
