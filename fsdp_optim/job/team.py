"""An offline verb run by many processes (``torchrun ... -m fsdp_optim reshard ...``): the :class:`Team` they form
and the :class:`Watch` that keeps them together while each does its share.

Every collective here is bounded (:data:`TIMEOUT_S`) and runs over gloo groups of its own, so a verb run inside a
training job (an NCCL default group, a long timeout) neither shares the job's group nor waits on it. The watch is
a thread per process that, every :data:`PERIOD_S`, all-gathers one integer per process: the bytes it has done and
its state (working, done, failed). That one round is the liveness check and the progress bar both::

    process 0: (bytes 1.2 GB, working)  process 1: (bytes 1.1 GB, done)    -> bar at 2.3 GB, go on
    process 0: (bytes 1.3 GB, failed)   process 1: ...                     -> every process stops
    process 1 killed                                                       -> the round fails within the timeout

Every process takes the same decision from the same gathered values, so the threads stop in the same round.
Cost: one 8-byte all-gather per process per period.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fsdp_optim.job.launcher import launched
from fsdp_optim.job.transport import (
    ProcessGroup,
    agree,
    all_gather_digests,
    broadcast_object,
    dist_rank_and_size,
    gather_objects,
    group_initialized,
    join_from_env,
    new_gloo_group,
    release_group,
)

__all__ = ["PERIOD_S", "TIMEOUT_S", "PeerFailed", "Team", "Watch", "team_of_job"]

PERIOD_S = 0.5  # the watch's rounds
TIMEOUT_S = 30.0  # every collective of a team: a lost process fails the others within this (and one period)
_WORKING, _DONE, _FAILED = 0, 1, 2


T = TypeVar("T")  # what a team sends


class PeerFailed(ConnectionError):
    """Another process of the team failed or was lost (``contact_lost``: died or hangs, so it can agree on
    nothing more): this one stopped its share because of it."""

    def __init__(self, message: str, *, contact_lost: bool = False) -> None:
        super().__init__(message)
        self.contact_lost = contact_lost


@dataclass(frozen=True)
class Team:
    """The processes of one offline verb: this one's ``rank`` of ``size``; ``control`` (agreements, the plan's
    broadcast, the records' gather) and ``beat`` (the watch) are gloo groups of their own."""

    rank: int
    size: int
    control: ProcessGroup
    beat: ProcessGroup

    def agree(self, failure: BaseException | None, what: str) -> None:
        """:func:`~fsdp_optim.job.transport.agree`; a :class:`PeerFailed` is not this process's own failure: the
        failing process's error is raised instead."""
        if isinstance(failure, PeerFailed) and failure.contact_lost:
            raise failure
        agree(None if isinstance(failure, PeerFailed) else failure, group=self.control, what=what)
        if failure is not None:  # a peer that failed has told its error above; one that was lost cannot
            raise failure

    @contextmanager
    def step(self, what: str, *, watch: Watch | None = None) -> Iterator[None]:
        """:func:`fsdp_optim.job.agreed.step` over the team's ``control`` group. With ``watch``, the watch is finished
        first, so a peer's failure it saw is raised as the peer's error. Unlike a job's step, a ``BaseException``
        (Ctrl-C in one process) is agreed on too: an offline verb holds no interrupt, and the others stop with it
        rather than wait for the team's timeout."""
        try:
            yield
        except BaseException as exc:
            self._end(exc, what, watch)
            raise
        self._end(None, what, watch)

    def _end(self, failure: BaseException | None, what: str, watch: Watch | None) -> None:
        """A step's end: ``watch`` stopped, then :meth:`agree` on the outcome."""
        if watch is not None:
            try:
                watch.finish(failure)
            except PeerFailed as exc:  # (``failure`` was None: finish checks only then)
                self.agree(exc, what)
                raise
        self.agree(failure, what)

    def from_first(self, obj: Any) -> Any:
        return broadcast_object(obj, src=0, group=self.control)

    def to_first(self, obj: T) -> list[T] | None:
        return gather_objects(obj, dst=0, group=self.control)

    def close(self) -> None:
        """Release the team's own groups (the default group stays up)."""
        release_group(self.beat)
        release_group(self.control)

    def progress(self, total: int, *, bar: bool = False, trim: Callable[[], None] | None = None) -> Watch:
        """A started :class:`Watch` that counts this process's bytes itself: hand its :meth:`Watch.advance` to a
        writer as its ``after(nbytes)``, which also calls ``trim()`` (drop what was read) and :meth:`Watch.check`::

            watch = team.progress(layout.size, bar=bar, trim=opened.trim)
            with team.step("consolidate failed on another process", watch=watch):
                write_tensors(path, layout, run, after=watch.advance)
        """
        return Watch(self, total if bar and self.rank == 0 else None, trim=trim)


def team_of_job(timeout_s: float = TIMEOUT_S) -> Team | None:
    """The team of this process: the default process group's processes when one is up, or joined as ``torchrun``
    describes them (:func:`launched`); ``None`` for a process on its own. A collective: every process calls it."""
    if not group_initialized():
        if not launched():
            return None
        join_from_env(timeout_s)
    rank, size = dist_rank_and_size(None)
    if size == 1:
        return None
    return Team(rank, size, new_gloo_group(None, timeout_s=timeout_s), new_gloo_group(None, timeout_s=timeout_s))


class Watch:
    """The thread of the module docstring; the main thread calls :meth:`check` often and :meth:`finish` once."""

    def __init__(self, team: Team, total: int | None, *, trim: Callable[[], None] | None = None) -> None:
        self.done = 0  # this process's bytes, as :meth:`advance` counts them
        self.team, self.trim = team, trim
        self.state = _WORKING
        self.lost: str | None = None
        self.contact_lost = False
        self.everyone = 0  # the bytes every process had done at the last round (what the bar shows)
        self.bar: Any = None
        if total is not None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=True,
                            desc=f"{team.size} processes")  # fmt: skip
        self.thread = threading.Thread(target=self._run, name="fsdp-optim-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            state = self.state
            try:
                beats = all_gather_digests(self.done << 2 | state, self.team.beat)
            except Exception as exc:  # a process died or hangs: this round cannot complete
                self.lost = f"lost contact with another process ({' '.join(str(exc).split())[:300]})"
                self.contact_lost = True
                break
            self.everyone = sum(b >> 2 for b in beats)
            if self.bar is not None:
                self.bar.update(self.everyone - self.bar.n)
            states = [b & 3 for b in beats]
            failed = [r for r, s in enumerate(states) if s == _FAILED]
            if failed:
                if state != _FAILED:
                    self.lost = f"process {failed[0]} of {self.team.size} failed"
                break
            if all(s == _DONE for s in states):
                break
            time.sleep(PERIOD_S)
        if self.bar is not None:
            self.bar.close()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more done by this process: counted, ``trim()`` called, then :meth:`check`."""
        self.done += nbytes
        if self.trim is not None:
            self.trim()
        self.check()

    def check(self) -> None:
        """:class:`PeerFailed` once another process failed or was lost: this one stops its share there."""
        if self.lost is not None:
            raise PeerFailed(self.lost, contact_lost=self.contact_lost)

    def finish(self, failure: BaseException | None) -> None:
        """Tell the others this share is done or failed, wait until every process has said so; then :meth:`check`."""
        self.state = _DONE if failure is None else _FAILED
        self.thread.join()
        if failure is None:
            self.check()
