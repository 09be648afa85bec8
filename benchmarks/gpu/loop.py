"""A training loop with one async save every ``every`` steps: how much slower are the steps that run while a save
is in the background than those that run without one (the save call's own blocking part is its own row)."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import torch
from torch import nn

import fsdp_optim
from benchmarks.gpu.models import Config, step, sync


def loop(model: nn.Module, optim: torch.optim.Optimizer, config: Config, steps: int = 40, every: int = 10) -> dict:
    busy: list[float] = []
    idle: list[float] = []
    handle = None
    for s in range(steps):
        if s % every == 0:
            if handle is not None:
                handle.wait()
            path = os.path.join(config.directory, "loop")
            shutil.rmtree(path, ignore_errors=True)
            handle = fsdp_optim.async_save_checkpoint(model, optim, path)
        in_flight = handle is not None and not handle.done()
        sync(config)
        start = time.perf_counter()
        step(model, optim, config)
        sync(config)
        if s >= every:  # the first interval warms up
            (busy if in_flight else idle).append(time.perf_counter() - start)
    if handle is not None:
        handle.wait()
    if not busy or not idle:
        return {"busy steps": len(busy), "idle steps": len(idle)}
    slowdown = statistics.median(busy) / statistics.median(idle)
    return {"busy steps": len(busy), "idle steps": len(idle), "step, save in flight": statistics.median(busy),
            "step, no save": statistics.median(idle), "slowdown": slowdown}  # fmt: skip
