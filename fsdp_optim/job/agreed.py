"""One team step: a piece of work run on every rank whose outcome every rank agrees on.

``with step("write share", group=g): ...`` runs its body, catches an ``Exception`` it raises, and makes every
rank of ``g`` agree on the outcome (:func:`~fsdp_optim.job.transport.agree`): when any rank failed, every rank
raises (a failing rank its own error, the others the first failing rank's, naming that rank and ``what``); else
none does. Cost: one all-gather of an int per step, and one of the errors when some rank failed.

``BaseException``s that are not ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) pass through unagreed, as
they always did: :mod:`fsdp_optim.job.interrupts` holds a Ctrl-C until a save's outcome is agreed.

:meth:`fsdp_optim.job.team.Team.step` is the same for an offline team, with its watch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fsdp_optim.job.transport import ProcessGroup, agree

__all__ = ["step"]


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
