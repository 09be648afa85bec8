"""A training loop with an async save at the start of every interval of ``every`` steps: how much slower are the
steps that run while a save is in the background than those that run without one (the save call's own blocking
part is its own row, outside every step's clock), for ours and for DCP's ``async_save``, measured the same way.

Each step is timed by events recorded on the training stream around it (:class:`StepClock`), read once the
interval is over: no device-wide sync around a step, so a step that waits for the save's copies (the stream waits
on the copy's event) or shares the GPU with them shows as it would in training. Reported: the median step without
a save, the median and the worst step while one is in flight, and the ratios. On the CPU the host's clock stands in
for the events (``step clock`` says which).

``every`` is chosen so that a save fits in two thirds of an interval: at least 10 steps, and enough steps for
1.5 x the save's committed time (``save_s``, measured by the rows) at the step time of the baseline, the steps timed
first with no save anywhere, bounded so the whole loop stays within ``budget_s``. The baseline's steps count as
steps without a save, so the verdict comes even where a save outlasts its interval; ``saves that fit`` says how
many saves were done before their interval ended.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

import fsdp_optim
from benchmarks.gpu.models import Config, step

WARMUP, BASELINE, INTERVALS, LEAST = 3, 10, 2, 10


class Handle(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> Any: ...


class StepClock:
    """Steps' times: CUDA events on the current (training) stream around each step on a GPU, read at :meth:`read`;
    the host's clock on the CPU."""

    def __init__(self, config: Config) -> None:
        self.on_gpu = config.on_gpu
        self.marks: list[tuple[Any, Any, list[float]]] = []

    def time(self, fn: Callable[[], None], into: list[float]) -> None:
        if self.on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.marks.append((start, end, into))
            return
        begin = time.perf_counter()
        fn()
        into.append(time.perf_counter() - begin)

    def read(self) -> None:
        """Every step timed so far into its list (waits for the last event alone, not the device)."""
        for start, end, into in self.marks:
            end.synchronize()
            into.append(start.elapsed_time(end) / 1e3)
        self.marks.clear()

    @property
    def kind(self) -> str:
        return "CUDA events on the training stream" if self.on_gpu else "host clock (CPU stand-in for the events)"


def interval(step_s: float, save_s: float, budget_s: float, least: int = LEAST) -> int:
    """Steps per interval: a save in two thirds of it, at least ``least``, at most what ``budget_s`` allows."""
    wanted = max(least, math.ceil(1.5 * save_s / step_s))
    most = max(least, int(budget_s / (INTERVALS * step_s)))
    return min(wanted, most)


def loop(model: nn.Module, optim: torch.optim.Optimizer, config: Config, *, save_s: float, budget_s: float = 30.0,
         save: Callable[[str], Handle] | None = None, least: int = LEAST) -> dict[str, Any]:  # fmt: skip
    """The loop's record (module doc); ``save(path)`` starts an async save (default: ours); ``least``: the fewest
    steps of the baseline and of an interval (the CPU mode's few steps show that it runs, not what it achieves)."""
    start_save = save or (lambda path: fsdp_optim.async_save_checkpoint(model, optim, path))
    clock = StepClock(config)
    for _ in range(WARMUP):
        step(model, optim, config)
    idle: list[float] = []
    busy: list[float] = []
    for _ in range(max(least, BASELINE * least // LEAST)):
        clock.time(lambda: step(model, optim, config), idle)
    clock.read()
    every = interval(statistics.median(idle), save_s, budget_s, least)
    fit = 0
    path = os.path.join(config.directory, "loop")
    for _ in range(INTERVALS):
        shutil.rmtree(path, ignore_errors=True)
        handle = start_save(path)
        for _ in range(every):
            clock.time(lambda: step(model, optim, config), busy if not handle.done() else idle)
        fit += handle.done()
        handle.wait()
        clock.read()
    shutil.rmtree(path, ignore_errors=True)
    record: dict[str, Any] = {"every": every, "saves": INTERVALS, "saves that fit": fit, "save committed s": save_s,
                              "busy steps": len(busy), "idle steps": len(idle), "step clock": clock.kind,
                              "step, no save": statistics.median(idle)}  # fmt: skip
    if busy:
        no_save = statistics.median(idle)
        record |= {"step, save in flight": statistics.median(busy), "worst step, save in flight": max(busy),
                   "slowdown": statistics.median(busy) / no_save, "worst slowdown": max(busy) / no_save}  # fmt: skip
    return record


class DcpHandle:
    """DCP's ``async_save`` response as a :class:`Handle`: done once its upload (its write) is."""

    def __init__(self, response: Any) -> None:
        self.future = getattr(response, "upload_completion", response)

    def done(self) -> bool:
        return bool(self.future.done())

    def wait(self) -> Any:
        return self.future.result()
