"""Timing and memory of collective calls, the same way for every method, methods interleaved.

Methods are measured round-robin (the order rotating every round), so that a drift in background load
on a shared machine hits every method alike and the ratios stay meaningful. Before each call: the
method's untimed ``prepare`` (if any), a cleanup (``gc`` + glibc ``malloc_trim``, so freed memory goes
back to the OS and "fresh" allocations really fault in new pages), a peak-RSS reset, and a barrier;
after it, the method's untimed ``finish`` (if any). Each rank times its own call; a call's latency is
the slowest rank's; the figure reported is the median over the timed rounds after the warm-up rounds. Peak RSS growth is VmHWM after the call minus VmRSS before it (Linux:
writing ``5`` to ``/proc/self/clear_refs`` resets VmHWM), with the call's result still alive; reported
as the largest over the timed rounds.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .peak import MiB, reset_peak, status_bytes

__all__ = ["Measurement", "Method", "MiB", "NotAvailable", "measure", "release_memory", "tensor_bytes"]


def release_memory() -> None:
    """Collect garbage and return freed memory to the system (glibc ``malloc_trim``)."""
    reset_peak()


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages reachable through dicts/lists/tuples in ``obj``."""
    seen: dict[int, int] = {}

    def visit(x: Any) -> None:
        if torch.is_tensor(x):
            storage = (x.to_local() if hasattr(x, "to_local") else x).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(obj)
    return sum(seen.values())


@dataclass(frozen=True)
class Method:
    """A collective every rank enters. ``check(result)`` (recipient, first call) returns a note or ""."""

    call: Callable[[], Any]
    check: Callable[[Any], str] | None = None
    prepare: Callable[[], None] | None = None  # untimed, before each call
    finish: Callable[[], None] | None = None  # untimed, after each call


@dataclass
class Measurement:
    """One method at one world size, as the recipient reports it."""

    times_s: list[float]  # per timed call: the slowest rank's latency
    rss_recipient: int  # bytes: largest peak RSS growth over the timed calls, recipient rank
    rss_other: int | None  # the same on one other rank (None at world size 1)
    out_bytes: int | None  # tensor bytes of the recipient's result (first call)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


@dataclass
class NotAvailable:
    reason: str


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return (text if isinstance(exc, RuntimeError) and text else f"{type(exc).__name__}: {text}")[:200]


def first_error(error: str) -> str:
    """Every rank's error (or "") -> the first non-empty one, the same on every rank."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")


def _run_check(method: Method, result: Any) -> str:
    if method.check is None:
        return ""
    try:
        return method.check(result)
    except Exception as exc:  # the benchmark's own check must not make a method n/a
        traceback.print_exc()
        return f"result not checked ({_short(exc)})"


def _rounds(
    methods: dict[str, Method],
    names: list[str],
    warmup: int,
    repeats: int,
    recipient: int,
    sync: Callable[[], None] | None,
    times: dict[str, list[float]],
    growths: dict[str, list[int]],
    first: dict[str, tuple[int | None, str]],
    failed: dict[str, str],
) -> None:
    """The loop of :func:`measure`: fills ``times``, ``growths``, ``first`` and ``failed`` in place."""
    rank = dist.get_rank()
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            if name in failed:
                continue
            method = methods[name]
            error = ""
            try:
                if method.prepare is not None:
                    method.prepare()
                base = reset_peak()
                dist.barrier()
                start = time.perf_counter()
                result = method.call()
                if sync is not None:
                    sync()
                elapsed = time.perf_counter() - start
                growth = status_bytes("VmHWM") - base
                if name not in first and rank == recipient:
                    first[name] = (tensor_bytes(result), _run_check(method, result))
                del result
                if method.finish is not None:
                    method.finish()
            except Exception as exc:  # a method that cannot run here is reported, not dropped silently
                error = _short(exc)
                traceback.print_exc()
            error = first_error(error)
            if error:
                failed[name] = error
            elif i >= warmup:
                times[name].append(elapsed)
                growths[name].append(growth)


def measure(
    methods: dict[str, Method],
    *,
    warmup: int,
    repeats: int,
    recipient: int = 0,
    sync: Callable[[], None] | None = None,
) -> dict[str, Measurement | NotAvailable] | None:
    """Measure every method, round-robin; see the module docstring.

    A method that raises on any rank is dropped from later rounds and reported as ``NotAvailable`` with
    the first rank's reason. ``sync`` waits for device work (CUDA) before a clock is read. Returns the
    results on ``recipient``, ``None`` elsewhere.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    growths: dict[str, list[int]] = {n: [] for n in names}
    first: dict[str, tuple[int | None, str]] = {}
    failed: dict[str, str] = {}
    # Everything alive now outlives the loop: freezing it makes each cleanup's gc.collect() scan only
    # what the calls created (milliseconds instead of ~0.2 s per call once torch._dynamo is imported).
    gc.collect()
    gc.freeze()
    try:
        _rounds(methods, names, warmup, repeats, recipient, sync, times, growths, first, failed)
    finally:
        gc.unfreeze()
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, (times, {n: max(g, default=0) for n, g in growths.items()}))
    if rank != recipient:
        return None
    other = 1 if world_size > 1 else None
    out: dict[str, Measurement | NotAvailable] = {}
    for name in names:
        if name in failed:
            out[name] = NotAvailable(failed[name])
            continue
        out_bytes, note = first.get(name, (None, ""))
        out[name] = Measurement(
            times_s=[max(t[name][k] for t, _ in everyone) for k in range(repeats)],
            rss_recipient=everyone[recipient][1][name],
            rss_other=everyone[other][1][name] if other is not None else None,
            out_bytes=out_bytes,
            note=note,
        )
    return out
