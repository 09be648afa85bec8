"""Start ``world_size`` fresh processes on one process group and bring one rank's result back.

Like ``tests/_dist.py`` but for long runs: the collective timeout and the deadline are arguments, the
backend is chosen by the caller, and every rank is pinned to one intra-op thread before torch starts
(``OMP_NUM_THREADS=1`` is inherited through the environment).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, backend: str, timeout_s: float, out_dir: str, fn: Callable, args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import warnings

    warnings.filterwarnings("ignore")  # FSDP1 deprecation and DCP notices, once per rank, per call
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:  # every failure goes back to the parent with its traceback
        outcome = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    collective_timeout_s: float = 300,
    deadline_s: float = 1800,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return every rank's result.

    Raises ``RuntimeError`` with each failing rank's traceback, or when the deadline passes (ranks killed).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), backend, collective_timeout_s, out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        stop_at = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > stop_at:
                    raise RuntimeError(f"world size {world_size}: ranks still running after {deadline_s:.0f}s")
        except mp.ProcessRaisedException:
            pass  # the failing rank wrote its traceback; collected below
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: exited without a result (exit code {ctx.processes[rank].exitcode})")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
