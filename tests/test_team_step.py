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
