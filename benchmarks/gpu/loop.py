"""A training loop with an async save at the start of every interval of ``every`` steps: how much slower are the
steps that run while a save is in the background than those that run without one (the save call's own blocking
part is its own row, outside every step's clock).

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
from typing import Any

import torch
from torch import nn

import fsdp_optim
from benchmarks.gpu.models import Config, step, sync

WARMUP, BASELINE, INTERVALS, LEAST = 3, 10, 2, 10


def _timed_step(model: nn.Module, optim: torch.optim.Optimizer, config: Config) -> float:
    sync(config)
    start = time.perf_counter()
    step(model, optim, config)
    sync(config)
    return time.perf_counter() - start


def interval(step_s: float, save_s: float, budget_s: float) -> int:
    """Steps per interval: a save in two thirds of it, at least ``LEAST``, at most what ``budget_s`` allows."""
    wanted = max(LEAST, math.ceil(1.5 * save_s / step_s))
    most = max(LEAST, int(budget_s / (INTERVALS * step_s)))
    return min(wanted, most)


def loop(model: nn.Module, optim: torch.optim.Optimizer, config: Config, *, save_s: float, budget_s: float = 30.0) -> dict[str, Any]:
    for _ in range(WARMUP):
        step(model, optim, config)
    idle = [_timed_step(model, optim, config) for _ in range(BASELINE)]
    every = interval(statistics.median(idle), save_s, budget_s)
    busy: list[float] = []
    fit = 0
    path = os.path.join(config.directory, "loop")
    for _ in range(INTERVALS):
        shutil.rmtree(path, ignore_errors=True)
        handle = fsdp_optim.async_save_checkpoint(model, optim, path)
        for _ in range(every):
            in_flight = not handle.done()
            (busy if in_flight else idle).append(_timed_step(model, optim, config))
        fit += handle.done()
        handle.wait()
    shutil.rmtree(path, ignore_errors=True)
    record: dict[str, Any] = {"every": every, "saves": INTERVALS, "saves that fit": fit, "save committed s": save_s,
                              "busy steps": len(busy), "idle steps": len(idle), "step, no save": statistics.median(idle)}  # fmt: skip
    if busy:
        record |= {"step, save in flight": statistics.median(busy), "slowdown": statistics.median(busy) / statistics.median(idle)}
    return record
