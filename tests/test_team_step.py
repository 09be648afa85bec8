"""One team step (``fsdp_optim.job.agreed.step``, ``Team.step``): every rank runs the body, and when any rank
fails every rank raises the failing rank's error; when none does, none raises. Real gloo groups, real processes."""

from __future__ import annotations

import pytest
from _dist import run_ranks


def _step(rank: int, world_size: int, failing: int | None) -> str:
    import torch.distributed as dist

    from fsdp_optim.job.agreed import step

    try:
        with step("write share", group=dist.group.WORLD):
            if rank == failing:
                raise ValueError(f"bad bytes on {rank}")
    except ValueError as exc:
        return f"raised: {exc}"
    return "none"


@pytest.mark.parametrize("failing", [None, 0, 1])
def test_every_rank_raises_the_failing_ranks_error_or_none_does(failing: int | None) -> None:
    outcomes = run_ranks(_step, 3, failing)
    if failing is None:
        assert outcomes == ["none"] * 3
        return
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith(f"raised: bad bytes on {failing}"), (rank, outcome)
        if rank != failing:
            assert f"[raised on rank {failing}; write share]" in outcome, outcome


def _share(rank: int, world_size: int, failing: int | None) -> tuple[str, int, int]:
    """A share of 3 x 5 bytes under ``Team.step`` with a ``Team.progress`` watch; ``failing`` fails after it."""
    from fsdp_optim.job.team import team_of_job

    team = team_of_job()
    assert team is not None, "a team of 3"
    trims = [0]
    try:
        watch = team.progress(15 * world_size, trim=lambda: trims.__setitem__(0, trims[0] + 1))
        try:
            with team.step("write share", watch=watch):
                for _ in range(3):
                    watch.advance(5)
                if rank == failing:
                    raise ValueError(f"bad bytes on {rank}")
        except ValueError as exc:
            return f"raised: {exc}", watch.done, trims[0]
        return "none", watch.everyone, trims[0]
    finally:
        team.close()


@pytest.mark.parametrize("failing", [None, 2])
def test_a_watched_step_counts_trims_and_raises_the_failing_process_error(failing: int | None) -> None:
    """``Team.progress``'s ``advance`` counts this process's bytes and trims; with the watch, ``Team.step`` finishes
    it first, so every process raises the failing one's error, naming it and the step."""
    outcomes = run_ranks(_share, 3, failing, deadline_s=120)
    for rank, (outcome, counted, trims) in enumerate(outcomes):
        assert trims == 3, f"process {rank} trimmed after each advance: {trims}"
        if failing is None:
            assert (outcome, counted) == ("none", 45), f"process {rank}: every process's bytes at the last round"
            continue
        assert outcome.startswith(f"raised: bad bytes on {failing}"), (rank, outcome)
        assert counted == 15, f"process {rank} counted its own bytes: {counted}"
        if rank != failing:
            assert f"[raised on rank {failing}; write share]" in outcome, outcome
