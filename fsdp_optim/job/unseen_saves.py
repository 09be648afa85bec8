"""No async save is lost in silence: a failure nobody saw ends the process loudly, with a non-zero exit.

An async save runs on a thread of its own; its failure is raised by ``handle.wait()`` (or by the next save of the
same model). A job that never calls ``wait()`` -- or calls ``dist.destroy_process_group()`` first, which makes
the save's last collectives fail -- would otherwise exit 0 with no checkpoint and no word.

:func:`watch` registers a hook that runs when the process ends, in the main thread, before Python joins the
remaining threads (``threading``'s own exit hooks: also in a ``multiprocessing`` child, which skips ``atexit``). It
waits for every save still in flight (so a save that can still commit does), then, for each one that failed and
whose error nobody has seen, prints what was lost (the save, its directory, the error, the fix) to stderr and ends
the process with exit status 1 (``os._exit``: the status of a normal exit cannot be changed from an exit hook).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Protocol

__all__ = ["EXIT_STATUS", "lost_message", "watch"]

EXIT_STATUS = 1


class Watched(Protocol):
    """What the exit hook asks of an async save's handle (:class:`fsdp_optim.job.async_save.AsyncSave`)."""

    @property
    def name(self) -> str: ...

    @property
    def directory(self) -> object: ...

    def done(self) -> bool: ...

    def unseen_error(self, timeout: float | None) -> BaseException | None: ...


_lock = threading.Lock()
_watched: list[Watched] = []  # saves whose outcome nobody has seen yet (pruned at each new watch)
_registered = False


def watch(handle: Watched) -> None:
    """Keep ``handle`` until it is seen or the process ends; the first call registers the exit hook."""
    global _registered
    with _lock:
        _watched[:] = [h for h in _watched if not h.done() or h.unseen_error(0) is not None]
        _watched.append(handle)
        if not _registered:
            register = getattr(threading, "_register_atexit", None)  # before threads are joined (Python >= 3.9)
            (register or atexit.register)(_at_exit)
            _registered = True


def lost_message(handle: Watched, error: BaseException) -> str:
    """What the exit hook prints for a save that failed unseen."""
    return (
        f"fsdp_optim: ERROR: async save {handle.name} into {handle.directory} FAILED and nobody called wait(); "
        f"no checkpoint was committed there. {type(error).__name__}: {error}\n"
        "fsdp_optim: call handle.wait() on every rank before dist.destroy_process_group() or the end of the job; "
        f"exiting with status {EXIT_STATUS}"
    )


def _at_exit() -> None:
    with _lock:
        pending = list(_watched)
        _watched.clear()
    lost = [(h, e) for h in pending if (e := h.unseen_error(None)) is not None]
    if not lost:
        return
    for handle, error in lost:
        print(lost_message(handle, error), file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_STATUS)
