"""The one helper every multi-process test uses: spawn ``world_size`` ranks on a real gloo process group.

``run_ranks(fn, world_size, *args)`` starts fresh processes, joins them into a gloo group on
127.0.0.1 with a free port and a collective timeout, calls ``fn(rank, world_size, *args)`` in each, and
returns the per-rank return values (pickled back through files). An exception on any rank fails the
call with that rank's traceback; a rank stuck past the deadline is killed, so nothing can hang.

The ranks are forked from a ``forkserver`` that imported torch, fairscale and fsdp_optim once for the session (a
fresh process each, never a fork of pytest: a rank costs a fork, not a 1.5 s interpreter start and import), with
the caller's environment at the time of the call. ``FSDP_OPTIM_TEST_SPAWN=1`` starts each rank with ``spawn``.
"""

from __future__ import annotations

import datetime
import multiprocessing.forkserver
import os
import pickle
import random
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
# What the session's forkserver imports once (a superset of the other tests' lists: whichever starts it first wins).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "fairscale.nn", "fsdp_optim", "fsdp_optim.offline",
           "fsdp_optim.cli", "_dist", "_models", "_checks"]  # fmt: skip


PORTS = (10000, 20000)  # below the kernel's ephemeral range (32768-60999 here) and weed's admin pairs (20000-39999)


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a job's rendezvous. Not one ``bind(0)`` hands out: the kernel may hand a
    port just released to the next caller, so two pytest-xdist workers starting jobs together could share one and
    join each other's groups. It is drawn from ``PORTS``, below the ephemeral range that gloo's own listeners use, in
    this worker's own slice of it (``PYTEST_XDIST_WORKER``), so two workers never draw the same port."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    span = (PORTS[1] - PORTS[0]) // max(count, 1)
    low = PORTS[0] + (int(worker) % max(count, 1) if worker.isdigit() else 0) * span
    for _ in range(500):
        port = random.randrange(low, low + span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still in TIME_WAIT from an earlier job
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{low + span - 1} on 127.0.0.1 after 500 draws")


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple,
    timeout_s: float,
    backend: str,
    env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's, at the call (a forked rank has the server's otherwise)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        outcome = ("ok", result)
    except BaseException:  # report every failure, including assertion errors, to the parent
        outcome = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    write_whole(result_path, lambda f: pickle.dump(outcome, f))


def write_whole(path: str | os.PathLike[str], write: Callable[[Any], object]) -> None:
    """``write(f)`` into a temporary file beside ``path``, then renamed to it: a rank killed while writing (a
    rank's SIGKILL makes the job terminate the others) leaves no file rather than a file cut short."""
    partial = f"{os.fspath(path)}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        write(f)
    os.replace(partial, path)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline_s: float = 240,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    ``timeout_s`` is the process group's collective timeout (fault tests shorten it, the benchmark
    lengthens it); ``backend="nccl"`` gives each rank its own GPU (the benchmark, on a GPU machine).
    """
    spawn = os.environ.get("FSDP_OPTIM_TEST_SPAWN") == "1" or backend == "nccl"
    if not spawn:
        forkserver_context(PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), out_dir, fn, args, timeout_s, backend, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="spawn" if spawn else "forkserver",
        )
        stop_at = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > stop_at:
                    raise TimeoutError(f"ranks still running after {deadline_s}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # a rank failed: its traceback (or its absence) is reported below
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
            raise AssertionError("\n".join(errors))
        return results


def forkserver_context(preload: Sequence[str]) -> Any:
    """A ``forkserver`` context whose server has imported ``preload``, so a job costs a fork, not an
    interpreter start. The preload list takes effect when the server starts (the session's first call).

    The server imports ``preload`` before it learns the caller's ``sys.path`` (Python 3.11 drops it), but
    it inherits the environment: this checkout's root and ``tests/`` go on ``PYTHONPATH`` while it starts,
    ahead of whatever else is installed (an editable install elsewhere).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    saved = os.environ.get("PYTHONPATH")
    here = Path(__file__).resolve().parent
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here), *filter(None, [saved])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx
