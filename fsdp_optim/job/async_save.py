"""Asynchronous saves: training blocks only for the checks and the agreement on a save id (what a user sees:
docs/optimizer-state.md, "Asynchronous save").

:func:`launch` starts the background thread of every async save (optimizer-only, whole, the memory tier): it copies
the rank's state into staging buffers kept and reused across saves (:mod:`fsdp_optim.job.staging`), then runs the
save's commit (:func:`fsdp_optim.job.save_commit.commit_save`, as a synchronous save does). Until the copy is done,
what would change the saved state waits for it (:func:`_guard`). A thread, not a process: ``write``, ``fsync`` and
hashing release the GIL, and no second copy of the state is needed in shared memory.

Coordination runs on a gloo process group of its own (created once per root process group, like torchtitan's),
never on the training group, so the background thread's collectives cannot interleave with the training loop's. A
second one, made at the first save, tells a save that a rank is gone: a later save's check-in waits on a barrier over
it, which fails as soon as a rank's process dies (docs/whole-state.md, "A dead rank"). At most one save per root is
in flight: a new one first waits for the previous one, whose failure, if nobody called ``wait()``, is raised then.

No save is lost in silence: a job that never calls ``wait()`` (or destroys the process group first) would otherwise
exit 0 with no checkpoint and no word. :func:`_watch` registers a hook that runs when the process ends, in the main
thread, before Python joins the remaining threads (``threading``'s own exit hooks: also in a ``multiprocessing``
child, which skips ``atexit``): it waits for every save still in flight, then, for each that failed unseen, prints
what was lost to stderr and ends the process with :data:`EXIT_STATUS` (``os._exit``: the status of a normal exit
cannot be changed from an exit hook).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_optim.disk.location import Location, ObjectPath
from fsdp_optim.disk.locations import where
from fsdp_optim.job.root import verify_root
from fsdp_optim.job.save_commit import check_in_seconds, commit_save, read_for_save, start_save
from fsdp_optim.job.staging import HostStaging, StagedCopy, before_change, expect, ready_events
from fsdp_optim.job.transport import ProcessGroup, check_in, dist_rank_and_size, group_initialized, new_gloo_group

__all__ = ["EXIT_STATUS", "AsyncSave", "async_save_sharded_optim_state"]


class AsyncSave:
    """The handle of one asynchronous save: :meth:`wait` for its manifest path, :meth:`done` to poll."""

    def __init__(self, directory: Path | Location, name: str = "") -> None:
        self.directory = directory
        self.name = name  # the save id's first characters, as the background thread is named
        self._finished = threading.Event()
        self.progress = StagedCopy()  # the background copy of this rank's state: enqueued, then in host memory
        self.staged = self.progress.staged  # set once that copy is in host memory
        self._result: Path | ObjectPath | None = None
        self._error: BaseException | None = None
        self._reported = False

    def _run(self, upload: Any) -> None:
        try:
            self._result = upload()
        except BaseException as exc:  # surfaced by wait(), on this rank and (through agree) every rank
            self._error = exc if group_initialized() else _group_gone(self, exc)
        finally:
            self.progress.finish()  # never left unset: a step waiting for it must not hang on a failed save
            self._finished.set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until this rank's state is copied into host memory (the optimizer may then change it by any
        means); ``False`` if ``timeout`` seconds pass first."""
        return self.staged.wait(timeout)

    def __repr__(self) -> str:
        if not self._finished.is_set():
            status = "running"
        elif self._error is not None:
            status = f"failed: {type(self._error).__name__}: {self._error}"
        else:
            status = f"committed: {self._result}"
        return f"<AsyncSave into {str(self.directory)!r}: {status}>"

    def unseen_error(self, timeout: float | None) -> BaseException | None:
        """The save's error if it failed (within ``timeout`` seconds) and nobody has seen it; else ``None``."""
        if not self._finished.wait(timeout) or self._reported:
            return None
        return self._error

    def done(self) -> bool:
        """Whether the upload has finished (successfully or not); never blocks."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Path | ObjectPath:
        """Block until the checkpoint is committed; return the manifest path, or raise the save's error.

        Every rank raises when any rank failed (no manifest was written then). ``TimeoutError`` if
        ``timeout`` seconds pass first (the save goes on).
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"async save into {self.directory} still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._result is not None, "a finished save without an error has a manifest"
        return self._result


def _guard(optim: torch.optim.Optimizer, root: nn.Module) -> None:
    """Hooks that make what changes a saved root's state wait for the copy (loads call
    :func:`~fsdp_optim.job.staging.before_change` themselves): ``optim``'s ``step`` and ``load_state_dict``, the
    root's ``load_state_dict`` (on ``root.module`` too: fairscale loads through it), and any other optimizer over its
    parameters (:func:`_before_any_step`). Each hook registered once per object."""
    global _any_step_hook
    with _lock:
        if _any_step_hook is None:
            _any_step_hook = register_optimizer_step_pre_hook(_before_any_step)
        fresh = [thing for thing in (optim, root) if thing not in _guarded]
        _guarded.update(dict.fromkeys(fresh, True))
    if optim in fresh:  # the hooks are called with (optimizer, args, kwargs) and (optimizer, state_dict)
        optim.register_step_pre_hook(lambda changed, *_: before_change(changed))
        optim.register_load_state_dict_pre_hook(lambda changed, *_: before_change(changed))
    if root in fresh:
        alive = weakref.ref(root)  # a hook on the root must not keep it alive
        for module in {root, getattr(root, "module", root)}:
            module.register_load_state_dict_pre_hook(lambda *_: before_change(alive()))


def _before_any_step(optim: torch.optim.Optimizer, *_: object) -> None:
    """Before any optimizer's ``step``: a save still copying the weights of a root this optimizer updates comes
    first."""
    with _lock:
        copying = [root for root, handle in _inflight.items() if not handle.staged.is_set()]
    for root in copying:
        params = {id(p) for p in root.parameters()}
        if any(id(p) in params for group in optim.param_groups for p in group["params"]):
            before_change(root)


_lock = threading.Lock()
# One entry per live root, dropped with the root: a job that builds many roots (or saves many times) keeps
# at most one handle and one set of buffers per root it still holds (tests/test_async_save.py counts them).
_inflight: weakref.WeakKeyDictionary[nn.Module, AsyncSave] = weakref.WeakKeyDictionary()  # its last save
_guarded: weakref.WeakKeyDictionary[torch.optim.Optimizer | nn.Module, bool] = weakref.WeakKeyDictionary()  # hooked
_any_step_hook: Any = None  # the process's one pre-hook on every optimizer's step (_before_any_step)
_staging: weakref.WeakKeyDictionary[nn.Module, HostStaging] = weakref.WeakKeyDictionary()  # its reusable buffers
_groups: dict[ProcessGroup, ProcessGroup] = {}  # root process group -> the checkpoint coordination group
_alive: dict[ProcessGroup, ProcessGroup] = {}  # root process group -> the group its saves' check-ins wait on


MEET_S = 8.0  # how long a save's group creation waits for every rank, once they all checked in (docs/whole-state.md)


def checkpoint_group(group: ProcessGroup, *, meet_s: float | None = None) -> ProcessGroup:
    """The gloo group that coordinates async saves over ``group``'s ranks (created on first use, then kept; its
    creation bounded by ``meet_s`` seconds: a dead rank stops it then, not at the collective timeout)."""
    if group not in _groups:
        _groups[group] = new_gloo_group(group, create_within_s=meet_s)
    return _groups[group]


def check_in_alive(what: str, group: ProcessGroup) -> None:
    """A whole save's check-in (:func:`~fsdp_optim.job.transport.check_in`), waiting on ``group``'s liveness group
    too once a first save made it (a dead rank said at once); then, every rank being there, that group made if it is
    missing, within :data:`MEET_S`, over a group of every process of the job (making one is a collective over all)."""
    check_in(what, group, check_in_seconds(), alive=_alive.get(group))
    if group not in _alive and dist_rank_and_size(group)[1] == dist_rank_and_size(None)[1]:
        _alive[group] = new_gloo_group(group, create_within_s=MEET_S)


def async_save_sharded_optim_state(
    fsdp: nn.Module,
    optim: torch.optim.Optimizer,
    directory: str | os.PathLike[str] | Location,
    *,
    overwrite: bool = False,
) -> AsyncSave:
    """Start saving this rank's optimizer shard (and, on rank 0, the manifest) in the background.

    A collective: call on every rank. Returns once the state is checked and a save id agreed; the copy of this
    rank's state into host memory runs in the background, and the optimizer's next ``step()`` (or
    ``load_state_dict()``) waits for it (``handle.wait_staged()`` for any other change of the state).
    ``handle.wait()`` returns the manifest path (on every rank) or raises the save's error on every rank;
    ``handle.done()`` polls. The checkpoint is the optimizer's state at the time of this call. A second save
    while one is in flight waits for the first (and raises its error if it failed and nobody called
    ``wait()``). A process that exits or is killed mid-upload leaves
    the previous checkpoint in ``directory`` loadable (the manifest is committed last).

    The first call creates a gloo process group for checkpoint coordination over the root's ranks
    (a collective over the default group: every process of the job must make that first call).
    """
    finish_previous(fsdp)
    root = verify_root(fsdp)
    local = read_for_save(root, optim, read_scalars=False)  # no host sync here: values read from the copy
    group = checkpoint_group(root.group)
    # Rank 0 holds the directory's lock until the background commit (refusals raise here, on every rank).
    target = where(directory)
    save_id, lock = start_save(target, group, overwrite=overwrite, purpose="async_save_sharded_optim_state")
    upload = lambda staged: commit_save(  # noqa: E731 - the thread's whole job, in one call
        root.layout, local, staged, type(optim).__name__, target, save_id, group, lock=lock
    )
    return launch(fsdp, target, optim, local.state, upload, name=save_id[:8])


def finish_previous(key: nn.Module) -> None:
    """Before a new async save of root ``key``: let the one in flight finish (raising its unseen failure)."""
    with _lock:
        previous = _inflight.get(key)
    error = previous.unseen_error(None) if previous is not None else None
    if previous is not None and error is not None:
        previous._reported = True
        raise RuntimeError(
            f"the previous async save into {previous.directory} failed and nobody called wait(): "
            f"{type(error).__name__}: {error}"
        ) from error


def launch(
    key: nn.Module,
    directory: Path | Location,
    optim: torch.optim.Optimizer,
    state: Mapping[int, Mapping[str, Any]],
    upload: Callable[[Callable[[], dict[int, dict[str, Any]]]], Path | ObjectPath],
    *,
    name: str,
) -> AsyncSave:
    """Start the background thread of an async save of root ``key``: ``upload(staged)``, where ``staged()`` copies
    ``state`` (``{flat: {key: live tensor}}``) into this root's staging; then the arena is page-locked."""
    staging = staging_of(key)
    handle = AsyncSave(directory, name)
    ready = ready_events(state)  # now, in the caller's thread: the copies see the state as it is at the call

    def staged() -> dict[int, dict[str, Any]]:  # in the thread; optim.step() waits for it (_guard)
        try:
            return staging.copy(state, ready, handle.progress)
        finally:
            handle.progress.finish()

    _guard(optim, key)
    expect(optim, handle.progress)
    expect(key, handle.progress)
    with _lock:
        _inflight[key] = handle
    _watch(handle)  # a failure nobody sees ends the process loudly
    def job() -> Path | ObjectPath:
        try:
            return upload(staged)
        finally:  # before the next save of this root starts: it copies straight into page-locked memory
            staging.lock()

    threading.Thread(target=handle._run, args=(job,), name=f"fsdp_optim-async-save-{name}").start()
    return handle


def staging_of(key: nn.Module) -> HostStaging:
    """Root ``key``'s host memory for its async saves, made at its first and kept while the root lives."""
    with _lock:
        return _staging.setdefault(key, HostStaging())


def _group_gone(handle: AsyncSave, exc: BaseException) -> RuntimeError:
    """The error of a save whose process group was destroyed under it, saying so (the raw one names no save)."""
    error = RuntimeError(
        f"async save {handle.name} into {handle.directory} failed: the process group was destroyed "
        "(dist.destroy_process_group()) before the save finished, so it could not commit; call handle.wait() on "
        f"every rank before destroying the group ({type(exc).__name__}: {exc})"
    )
    error.__cause__ = exc
    return error


EXIT_STATUS = 1
_watched: list[AsyncSave] = []  # saves whose outcome nobody has seen yet (pruned at each new watch)
_registered = False


def _watch(handle: AsyncSave) -> None:
    """Keep ``handle`` until it is seen or the process ends; the first call registers the exit hook."""
    global _registered
    with _lock:
        _watched[:] = [h for h in _watched if not h.done() or h.unseen_error(0) is not None]
        _watched.append(handle)
        if not _registered:
            register = getattr(threading, "_register_atexit", None)  # before threads are joined (Python >= 3.9)
            (register or atexit.register)(_at_exit)
            _registered = True


def _at_exit() -> None:
    with _lock:
        pending = list(_watched)
        _watched.clear()
    lost = [(h, e) for h in pending if (e := h.unseen_error(None)) is not None]
    if not lost:
        return
    for handle, error in lost:
        print(f"fsdp_optim: ERROR: async save {handle.name} into {handle.directory} FAILED and nobody called wait(); "
              f"no checkpoint was committed there. {type(error).__name__}: {error}\n"
              "fsdp_optim: call handle.wait() on every rank before dist.destroy_process_group() or the end of the job; "
              f"exiting with status {EXIT_STATUS}", file=sys.stderr)  # fmt: skip
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_STATUS)
