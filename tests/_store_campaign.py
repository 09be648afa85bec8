"""The fault campaign's cases and the rank functions that run them (tests/test_object_store_faults.py).

A :class:`Case` is (operation, fault kind, which request gets it); its faults go to the proxy through a
:class:`~_fault_proxy.ProxyControl`, so one job (one spawn of the ranks) runs many cases in a row. Each case ends in
one of two outcomes, checked at once and fault-free:

- the operation succeeded and its result is bit-identical to the fault-free one (a checkpoint loads to the state it
  was saved from, a resharded one verifies and consolidates to the same full dict), or
- it raised a clear error (``OSError``/``ValueError`` naming the store) on every rank, and the checkpoint committed
  before it is intact (verifies, loads to its state) and no manifest of the failed save exists.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import _models as M
import torch
import torch.distributed as dist
from _checks import assert_identical
from _fault_proxy import Fault, FaultKind, ProxyControl

import fsdp_optim

KINDS: tuple[FaultKind, ...] = ("drop", "drop_response", "status503", "status500", "truncate")
# Which request gets the fault. "lasting" ones outlast every retry of a request of that method.
SELECTORS = ("first", "nth5", "nth11", "PUT", "GET", "HEAD", "ranged", "p1", "p2", "lasting-PUT", "lasting-GET")
SELECTORS += ("commit",)
# A whole save at W=2 puts 4 files (a rank and a side file per rank) before its manifest: "commit" hits every put
# from the 5th on, the manifest's first of all (its outcome then ambiguous: a lost response, a dropped retry).
FILES_BEFORE_MANIFEST = 4
TRUNCATE_AT = 100  # body bytes sent before a truncated response is cut
# botocore's attempts per request in the campaign, and s3fs's own retries around them (5 by default, with
# backoff); ours (fsdp_optim.disk.store_policy.ATTEMPTS) come on top: a lasting fault fails in seconds.
RETRIES = {"retries": {"total_max_attempts": 2}}
S3FS_RETRIES = 1
CLEAR = (OSError, ValueError)  # a clear error: what the library raises, naming the object


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    kind: FaultKind
    selector: str

    @property
    def id(self) -> str:
        return f"{self.op}-{self.kind}-{self.selector}"

    def faults(self) -> tuple[Fault, ...]:
        """The proxy rules of this case (a truncation hits GETs only: other responses have no body to cut)."""
        sel, methods = self.selector, {"GET"} if self.kind == "truncate" else None
        if sel == "commit":
            return (Fault(self.kind, count=None, methods={"PUT"}, after=FILES_BEFORE_MANIFEST),)
        if sel.startswith("lasting-"):
            return (Fault(self.kind, count=None, methods={sel.split("-")[1]}, truncate_at=TRUNCATE_AT),)
        if sel in ("PUT", "GET", "HEAD"):
            methods = {sel}
        rule: dict[str, Any] = {"methods": methods, "truncate_at": TRUNCATE_AT}
        if sel.startswith("nth"):
            rule.update(count=1, after=int(sel[3:]) - 1)
        elif sel == "ranged":
            rule.update(count=2, ranged=True)
        elif sel.startswith("p"):
            rule.update(count=6, probability=0.25, seed=int(sel[1:]))
        else:
            rule.update(count=2 if sel != "first" else 1)
        return (Fault(self.kind, **rule),)


def cases(op: str, kinds: tuple[str, ...] = KINDS, selectors: tuple[str, ...] = SELECTORS) -> list[Case]:
    out = []
    for kind in kinds:
        for sel in selectors:
            if kind == "truncate" and sel in ("PUT", "HEAD", "lasting-PUT", "commit"):
                continue  # nothing to truncate in those responses
            if sel == "commit" and op not in ("save", "async_save"):
                continue
            out.append(Case(op, kind, sel))  # type: ignore[arg-type]
    return out


@dataclasses.dataclass(frozen=True)
class Outcome:
    case: str
    ok: bool
    error: str | None  # "<type>: <message>" of a failure
    fired: int  # faults the proxy injected during the case
    seconds: float = 0.0  # how long the operation under faults took (to find slow cases, not asserted)


def fewer_retries() -> int:
    """s3fs's retries (a class attribute, not a storage option) down to :data:`S3FS_RETRIES`; returns the old."""
    import s3fs

    old, s3fs.S3FileSystem.retries = s3fs.S3FileSystem.retries, S3FS_RETRIES
    return old


def describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def check_clear(exc: BaseException, where: str, case: str) -> None:
    """A failure must be a clear error naming the store (or an object under it)."""
    assert isinstance(exc, CLEAR), f"{case}: not a clear error: {describe(exc)}"
    assert where in str(exc), f"{case}: the error does not name {where}: {describe(exc)}"


# -- in a job ---------------------------------------------------------------------------------------------------


def content(full: dict[str, Any] | None) -> dict[str, Any] | None:
    """A gathered full dict without its header (which names the world size)."""
    return None if full is None else {k: v for k, v in full.items() if k != "fsdp_optim"}


def snapshot(root: Any, optim: torch.optim.Optimizer, extra: Any) -> dict[str, Any]:
    """What a checkpoint of this job must load back to (a collective)."""
    return {"model": root.state_dict(), "optim": content(root.gather_full_optim_state_dict(optim)), "extra": extra}


def loaded(store: Any) -> dict[str, Any]:
    """A fresh model (other init) loaded from ``store``, as :func:`snapshot` shows it (a collective)."""
    root = M.wrap(M.make_net(seed=123), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    extra = fsdp_optim.load_checkpoint(root, optim, store)
    return snapshot(root, optim, extra)


def arm(control: ProxyControl, rank: int, faults: tuple[Fault, ...]) -> int:
    """Rank 0 sets the faults; every rank waits for it. Returns the faults fired so far (rank 0)."""
    fired = 0
    if rank == 0:
        fired = sum(control.stats().faults.values())
        control.set_faults(*faults)
    dist.barrier()
    return fired


def disarm(control: ProxyControl, rank: int, before: int) -> int:
    """Every rank done; rank 0 clears the faults and returns how many fired since ``before``."""
    dist.barrier()
    fired = 0
    if rank == 0:
        control.clear()
        fired = sum(control.stats().faults.values()) - before
    dist.barrier()
    return fired


def committed_id(store: Any) -> str:
    from fsdp_optim.formats.sharded.locate import read_manifest

    return read_manifest(store).save_id


def check_intact(rank: int, store: Any, expected: dict[str, Any], save_id: str, case: str) -> None:
    """Fault-free: the prefix verifies, its manifest is ``save_id``'s, and it loads to ``expected``."""
    if rank == 0:
        verification = fsdp_optim.verify(str(store))  # offline verbs take a URL (opened with the environment)
        assert verification.ok, f"{case}: {store} does not verify: {verification}"
        assert committed_id(store) == save_id, f"{case}: manifest {committed_id(store)}, expected {save_id}"
    assert_identical(loaded(store), expected, case)


def save_cases(
    rank: int, world_size: int, store: Any, env: dict[str, str], control: ProxyControl, todo: list[Case]
) -> list[Outcome]:
    """Train, save fault-free, then per case: a step, a save under faults, the outcome checked fault-free."""
    os.environ.update(env)
    fewer_retries()
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    step, out = 0, []

    def train_and_save(faults: tuple[Fault, ...], op: str) -> tuple[BaseException | None, int, float]:
        nonlocal step
        M.train_step(root, optim, *M.local_batch(step % 8, rank, world_size))
        step += 1
        before, error, start = arm(control, rank, faults), None, time.monotonic()
        try:
            if op == "async_save":
                fsdp_optim.async_save_checkpoint(root, optim, store, extra={"step": step}).wait()
            else:
                fsdp_optim.save_checkpoint(root, optim, store, extra={"step": step})
        except Exception as exc:
            error = exc
        seconds = time.monotonic() - start
        return error, disarm(control, rank, before), seconds

    error, _, _ = train_and_save((), "save")
    assert error is None, describe(error)
    committed, save_id = snapshot(root, optim, {"step": step}), committed_id(store)
    for case in todo:
        error, fired, seconds = train_and_save(case.faults(), case.op)
        if error is None:
            committed, save_id = snapshot(root, optim, {"step": step}), committed_id(store)
        else:
            check_clear(error, str(store), case.id)
        check_intact(rank, store, committed, save_id, case.id)
        out.append(Outcome(case.id, error is None, describe(error), fired, seconds))
    check_tidy_after_next_save(rank, store, lambda: train_and_save((), "save"))
    return out


def check_tidy_after_next_save(rank: int, store: Any, save: Any) -> None:
    """What failed saves left is gone after the next fault-free save, which starts in a later second than they
    ended (the store's modification times have a resolution of one second: the age rule needs them older)."""
    time.sleep(1.1)
    error, _, _ = save()
    assert error is None, describe(error)
    if rank == 0:
        from fsdp_optim.formats.sharded.locate import read_manifest

        listing = set(store.listing())
        expected = set(read_manifest(store).file_names()) | {"manifest.json"}
        assert listing == expected, f"{store}: left after the next save: {sorted(listing - expected)}"


def load_cases(
    rank: int,
    world_size: int,
    urls: dict[str, str],
    options: dict,
    control: ProxyControl,
    todo: list[Case],
    reference: list[dict[str, Any]],
) -> list[Outcome]:
    """Per case: a fresh model loads ``urls[case.op]`` under faults; it equals ``reference[rank]`` or fails clearly on every
    rank and then holds its own initial state (a failed load changes nothing)."""
    fewer_retries()
    out = []
    for case in todo:
        store = fsdp_optim.open_store(urls[case.op], **options)
        root = M.wrap(M.make_net(seed=123), "deep")
        optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
        initial = {k: v.clone() for k, v in root.state_dict().items()}
        before, error, extra = arm(control, rank, case.faults()), None, None
        start = time.monotonic()
        try:
            extra = fsdp_optim.load_checkpoint(root, optim, store)
        except Exception as exc:
            error = exc
        seconds = time.monotonic() - start
        fired = disarm(control, rank, before)
        if error is None:
            assert_identical(snapshot(root, optim, extra), reference[rank], case.id)
        else:
            check_clear(error, str(store), case.id)
            assert_identical(root.state_dict(), initial, f"{case.id}: a failed load changed the model")
            assert not optim.state, f"{case.id}: a failed load changed the optimizer"
        out.append(Outcome(case.id, error is None, describe(error), fired, seconds))
    return out


def job(
    rank: int,
    world_size: int,
    store: Any,
    env: dict[str, str],
    control: ProxyControl,
    todo: list[Case],
    urls: dict[str, str],
    options: dict,
    reference: list[dict[str, Any]],
) -> list[Outcome]:
    """One job for the cases of ``todo``: the saves' (into ``store``), then the loads' (of ``urls``)."""
    saves = [c for c in todo if c.op in ("save", "async_save")]
    loads = [c for c in todo if c not in saves]
    out = save_cases(rank, world_size, store, env, control, saves) if saves else []
    return out + (load_cases(rank, world_size, urls, options, control, loads, reference) if loads else [])


def save_reference(rank: int, world_size: int, store: Any) -> dict[str, Any]:
    """A few steps, then a fault-free save; returns what the checkpoint must load back to."""
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(3):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, store, extra={"step": 3})
    return snapshot(root, optim, {"step": 3})


def env_with(endpoint_env: dict[str, str]) -> dict[str, str]:
    """The process environment pointed at ``endpoint_env``'s server with the campaign's retries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | endpoint_env | {"AWS_MAX_ATTEMPTS": str(RETRIES["retries"]["total_max_attempts"])}
