"""A verb with no split of its own, run by a team: process 0 does it as one process would, the others wait for its
outcome (the watch keeps them in touch with bounded rounds, however long it takes) and share it: they raise its
error, or return its result's exit code. So ``torchrun ... -m fsdp_optim verify X`` behaves as one process does."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fsdp_optim.job.team import Team

__all__ = ["alone"]

T = TypeVar("T")


def alone(team: Team, run: Callable[[], T], what: str) -> T | None:
    """``run()`` on process 0 (its result there, ``None`` elsewhere); every process raises if it failed."""
    result: T | None = None
    with team.step(f"{what} failed on process 0", watch=team.progress(0)):
        if team.rank == 0:
            result = run()
    return result
