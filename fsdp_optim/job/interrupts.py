"""A Ctrl-C during a save lets the save finish first, so that every rank agrees on its outcome.

A Ctrl-C reaches every rank of a job (SIGINT to the process group), but each at a different point: one rank in
Python code raises ``KeyboardInterrupt`` at once, another blocked in a collective only when the collective returns,
which it never does once the first rank has left the save. The ranks then disagree (one says the save is done, the
other that it was interrupted), wait out the collective timeout, or mismatch their next collectives. Inside
:func:`interrupts_deferred` the first SIGINT is noted (and said on stderr); the save runs to its agreed end on every
rank (committed, or failed everywhere), and then ``KeyboardInterrupt`` is raised. A second SIGINT interrupts at once.

Only on the main thread, and only where SIGINT has Python's default handler (a program's own handler, such as the
CLI's, is left alone).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["interrupts_deferred"]


@contextlib.contextmanager
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
