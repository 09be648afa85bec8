"""Every timed row, for ours and for DCP: sync save, async save (blocking part, copy done, committed), load, and
the host-RSS and GPU-memory growth of each; on a GPU, ours' blocking part once more with the model on an NCCL-only
process group (``nccl_blocking``), where a host sync in the save's collectives would show. Round 0 warms up (allocations every later save reuses); the figures are
the median of the later rounds (memory: their largest)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fsdp_optim
from benchmarks.gpu.models import Config, sync
from benchmarks.peak import reset_peak, status_bytes


class Tally:
    """Per row: seconds of each later round, and the largest memory growth seen."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.growth: dict[str, int] = {}

    def add(self, row: str, seconds: float, warm: bool) -> None:
        if warm:
            self.seconds.setdefault(row, []).append(seconds)

    def grew(self, row: str, nbytes: int, warm: bool) -> None:
        if warm:
            self.growth[row] = max(self.growth.get(row, 0), nbytes)

    def medians(self) -> dict[str, float]:
        return {row: statistics.median(values) for row, values in self.seconds.items()}


WHOLE_ASYNC = "async save, whole"  # its memory rows: from the call until the save is committed
STAND_IN = "on the CPU the GPU memory rows hold the host RSS growth of the same span (no GPU memory exists)"


def watched(tally: Tally, row: str, warm: bool, config: Config, fn: Callable[[], Any], *, settle: bool = True) -> tuple[Any, float, tuple[int, int]]:
    """``fn()`` timed, with its peak host RSS growth (VmHWM over VmRSS) and GPU memory growth (peak over the start)
    tallied; ``(its result, the clock's start, the memory at the start)``. Outside the clock, before it starts: a
    device sync, collecting garbage, trimming malloc's free lists and resetting the peaks. ``settle``: the clock
    stops after a device sync (the work ``fn`` queued is part of it); without, when ``fn`` returns (an async save's
    blocking part)."""
    sync(config)
    gpu = _gpu_start(config)
    before = reset_peak()
    start = time.perf_counter()
    result = fn()
    if settle:
        sync(config)
    tally.add(row, time.perf_counter() - start, warm)
    grew(tally, row, warm, config, (before, gpu))
    return result, start, (before, gpu)


def grew(tally: Tally, row: str, warm: bool, config: Config, at_start: tuple[int, int]) -> None:
    """``row``'s peak growths since ``at_start`` (host RSS, GPU memory) tallied; on the CPU, the GPU memory row holds
    the host RSS growth (:data:`STAND_IN`)."""
    host = status_bytes("VmHWM") - at_start[0]
    tally.grew(f"{row}: host RSS", host, warm)
    tally.grew(f"{row}: GPU memory", torch.cuda.max_memory_allocated() - at_start[1] if config.on_gpu else host, warm)


def _gpu_start(config: Config) -> int:
    if not config.on_gpu:
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _fresh(config: Config, name: str) -> str:
    path = os.path.join(config.directory, name)
    shutil.rmtree(path, ignore_errors=True)
    return path


def _rows(config: Config, name: str, save: Callable[[str], Any] | None, load: Callable[[str], Any], async_save: Callable[[str], Any],
          staged: Callable[[Any], Any], committed: Callable[[Any], Any]) -> Tally:  # fmt: skip
    """Per round: ``save`` and ``load`` of a fresh directory (unless ``save`` is None), then ``async_save``: its blocking
    part, the time until ``staged(response)`` returns (the copy done) and until ``committed(response)`` returns."""
    tally = Tally()
    for r in range(config.repeats + 1):
        warm = r > 0
        if save is not None:
            path = _fresh(config, name)
            watched(tally, "sync save", warm, config, lambda: save(path))
            watched(tally, "load", warm, config, lambda: load(path))
        path = _fresh(config, f"{name}-async")
        # Copied and committed: from the call's start (after watched's untimed preparation) until staged / committed.
        response, start, at_start = watched(tally, "async save, blocking", warm, config, lambda: async_save(path), settle=False)
        staged(response)
        sync(config)
        tally.add("async save, copied", time.perf_counter() - start, warm)
        committed(response)
        tally.add("async save, committed", time.perf_counter() - start, warm)
        grew(tally, WHOLE_ASYNC, warm, config, at_start)  # the background copy and write included
    for left in (name, f"{name}-async"):  # /dev/shm holds one row's checkpoints at a time, not every row's
        shutil.rmtree(os.path.join(config.directory, left), ignore_errors=True)
    return tally


def ours(model: nn.Module, optim: torch.optim.Optimizer, config: Config) -> Tally:
    return _rows(config, "ours", lambda path: fsdp_optim.save_checkpoint(model, optim, path), lambda path: fsdp_optim.load_checkpoint(model, optim, path),
                 lambda path: fsdp_optim.async_save_checkpoint(model, optim, path), lambda handle: handle.wait_staged(), lambda handle: handle.wait())  # fmt: skip


NCCL_BLOCKING = "async save, blocking (NCCL group, after a step)"
NCCL_IDLE = "async save, blocking (NCCL group, GPU idle)"


def nccl_blocking(config: Config) -> Tally:
    """Ours' async save's blocking part with the model on a process group of NCCL alone (the default group mixes
    ``cpu:gloo,cuda:nccl``, whose gloo half runs the save's small CPU collectives without touching the GPU), called
    right after a training step whose kernels are still queued (``NCCL_BLOCKING``: a host sync in the blocking part,
    ``.tolist()`` or ``.item()``, waits for all of them) and with the GPU idle (``NCCL_IDLE``). GPU only."""
    import torch.distributed as dist

    from benchmarks.gpu.models import ours as our_model
    from benchmarks.gpu.models import step

    group = dist.new_group(backend="nccl")
    model, optim = our_model(config, group)
    tally = Tally()
    for r in range(config.repeats + 1):
        for row, queued in ((NCCL_IDLE, False), (NCCL_BLOCKING, True)):
            path = _fresh(config, "ours-nccl")
            step(model, optim, config)
            if not queued:
                sync(config)
            start = time.perf_counter()
            handle = fsdp_optim.async_save_checkpoint(model, optim, path)
            tally.add(row, time.perf_counter() - start, r > 0)
            handle.wait()
    shutil.rmtree(os.path.join(config.directory, "ours-nccl"), ignore_errors=True)
    del model, optim
    dist.destroy_process_group(group)
    return tally


def dcp_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def dcp_rows(model: nn.Module, optim: torch.optim.Optimizer, config: Config, stager: Any = None) -> Tally:
    """DCP as users call it (``stager=None``: sync save, load, default async) or async with ``stager`` only."""

    def staged(response: Any) -> None:
        if getattr(response, "staging_completion", None) is not None:
            response.staging_completion.result()

    save = (lambda path: dcp.save(dcp_state(model, optim), checkpoint_id=path)) if stager is None else None
    return _rows(config, "dcp", save, lambda path: _dcp_load(model, optim, path),
                 lambda path: dcp.async_save(dcp_state(model, optim), checkpoint_id=path, async_stager=stager), staged,
                 lambda response: getattr(response, "upload_completion", response).result())  # fmt: skip


def _dcp_load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    state = dcp_state(model, optim)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
