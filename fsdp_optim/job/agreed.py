"""One team step: a piece of work run on every rank whose outcome every rank agrees on, and a Ctrl-C held until
that outcome is agreed.

``with step("write share", group=g): ...`` runs its body, catches an ``Exception`` it raises, and makes every
rank of ``g`` agree on the outcome (:func:`~fsdp_optim.job.transport.agree`): when any rank failed, every rank
raises (a failing rank its own error, the others the first failing rank's, naming that rank and ``what``); else
none does. Cost: one all-gather of an int per step, and one of the errors when some rank failed.
``BaseException``s that are not ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) pass through unagreed.
:meth:`fsdp_optim.job.team.Team.step` is the same for an offline team, with its watch.

A Ctrl-C reaches every rank of a job (SIGINT to the process group), but each at a different point: one rank in
Python code raises ``KeyboardInterrupt`` at once, another blocked in a collective only when the collective returns,
which it never does once the first rank has left the save. The ranks then disagree, wait out the collective timeout,
or mismatch their next collectives. Inside :func:`interrupts_deferred` the first SIGINT is noted (and said on
stderr); the save runs to its agreed end on every rank, and then ``KeyboardInterrupt`` is raised. A second SIGINT
interrupts at once. Only on the main thread, and only where SIGINT has Python's default handler (a program's own
handler, such as the CLI's, is left alone).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from fsdp_optim.job.transport import ProcessGroup, agree

__all__ = ["interrupts_deferred", "step"]


@contextmanager
def step(what: str, *, group: ProcessGroup | None) -> Iterator[None]:
    """Run the body on every rank of ``group`` and agree on its outcome (the module docstring). Every rank must
    enter the step, whatever happened before it: a rank that skips it leaves the others waiting for the
    group's timeout."""
    try:
        yield
    except Exception as exc:
        agree(exc, group=group, what=what)  # raises ``exc`` itself on this rank
        raise
    agree(None, group=group, what=what)


@contextmanager
def interrupts_deferred(what: str) -> Iterator[None]:
    """Run the block with a first SIGINT deferred to its end (then ``KeyboardInterrupt``, if the block succeeded;
    its own error otherwise); a second SIGINT raises ``KeyboardInterrupt`` at once."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    seen: list[int] = []

    def later(signum: int, _frame: FrameType | None) -> None:
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)
        print(f"fsdp_optim: Ctrl-C during {what}: it finishes first on every rank (so they agree on its "
              "outcome), then the interrupt is raised; Ctrl-C again to interrupt it now", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen:
        raise KeyboardInterrupt(f"interrupted during {what}, which finished first")
