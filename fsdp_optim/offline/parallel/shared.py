"""A verb done by a team. :func:`alone`: a verb with no split of its own, done by process 0 as one process would
while the others wait for its outcome (the watch keeps them in touch with bounded rounds, however long it takes) and
share it (they raise its error), so ``torchrun ... -m fsdp_optim verify X`` behaves as one process does.

:func:`across`: a verb's :class:`~fsdp_optim.offline.work.Work` split: every process opens the inputs
alike and cuts the same pieces, runs its contiguous run of them
(:func:`~fsdp_optim.core.split.split_by_bytes`), process 0 puts the parts back in order and sends them to every
process, and each makes the report of them: the one one process makes.

Failures, as every offline verb of a team: opening is agreed first (every process raises the failing one's error);
then each process checks its :class:`~fsdp_optim.job.team.Watch` between pieces, so a piece that fails (a chunk
whose checksum does not match) or a process that is lost (killed) stops every process at its next piece, and
:meth:`~fsdp_optim.job.team.Team.step` makes each raise the first failing process's error.

Cost beyond the reading: three small agreements (opening, the pieces' count and bytes), the watch's rounds, one
gather of the parts to process 0 and one broadcast of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TypeVar

from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.job.team import Team
from fsdp_optim.offline.work import Piece, Work

__all__ = ["across", "alone"]

T = TypeVar("T")
R = TypeVar("R")


def alone(team: Team, run: Callable[[], R], what: str) -> R | None:
    """``run()`` on process 0 (its result there, ``None`` elsewhere); every process raises if it failed."""
    result: R | None = None
    with team.step(f"{what} failed on process 0", watch=team.progress(0)):
        if team.rank == 0:
            result = run()
    return result


def across(team: Team, opening: AbstractContextManager[Work[T, R]], what: str) -> R:
    """The report of the work ``opening`` yields (entered on every process, exited once the report is made), made
    by ``team`` as the module docstring says; ``what`` names the verb in errors (``"diff"``)."""
    with contextlib.ExitStack() as stack:
        with team.step(f"{what}: opening the inputs failed on another process"):
            work = stack.enter_context(opening)
        cut = (len(work.pieces), sum(p.nbytes for p in work.pieces))
        first = team.from_first(cut)
        mismatch = None if first == cut else ValueError(
            f"{what}: the processes cut the inputs differently: process 0 found {first[0]} pieces of {first[1]} "
            f"bytes, process {team.rank} {cut[0]} of {cut[1]} (did an input change while they opened it?)"
        )  # fmt: skip
        team.agree(mismatch, f"{what}: the processes cut the inputs differently")
        return work.report(_run_shared(team, work.pieces, what))


def _run_shared(team: Team, pieces: Sequence[Piece[T]], what: str) -> tuple[T, ...]:
    """This process's run of ``pieces``, then every process's parts, in order, on every process."""
    split = split_by_bytes([p.nbytes for p in pieces], team.size)
    watch = team.progress(sum(split.nbytes))
    mine: list[T] = []
    with team.step(f"{what} failed on another process", watch=watch):
        for i in split.runs[team.rank]:
            watch.check()  # another process failed or was lost: stop here
            mine += pieces[i].run()
            watch.advance(pieces[i].nbytes)
    gathered = team.to_first(mine)
    merged = None if gathered is None else [part for share in gathered for part in share]
    everyone: list[T] = team.from_first(merged)
    return tuple(everyone)
