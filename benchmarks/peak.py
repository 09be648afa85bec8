"""One operation in a process of its own, timed with its peak resident memory; the synthetic Adam state and the
durable writes the offline benchmarks share.

``measured(fn)`` collects garbage, trims malloc's free lists, resets the high-water mark (``clear_refs`` 5),
runs ``fn`` and returns ``(seconds, peak RSS growth in bytes, fn's result)``: the growth is ``VmHWM`` after
minus ``VmRSS`` before, so one operation's memory never hides another's when each runs in a process of its own:
a forked child (``in_child(fn)``) or a fresh interpreter (``fresh(module, op, ...)`` runs
``python -m <module> --measure op ...``, whose ``--measure`` branch ends with ``reply(**fields)``).
Linux only.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["adam_full_dict", "fresh", "fsync_path", "in_child", "measured", "reply", "rounds", "save_durably", "spawn_gloo", "status_bytes"]
ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (``VmRSS``: resident now, ``VmHWM``: peak since the reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Collect garbage, return free memory to the system, reset the peak; the resident bytes now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def measured(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """``fn()`` timed, with its peak RSS growth: ``(seconds, bytes, result)``."""
    before = reset_peak()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return seconds, status_bytes("VmHWM") - before, result


def rounds(methods: dict[str, Callable[[], Any]], *, warmup: int, repeats: int, rotate: bool = True, before: Callable[[str], Any] | None = None,
           after: Callable[[str], Any] | None = None, sync: Callable[[], Any] | None = None) -> dict[str, list[float]]:  # fmt: skip
    """Each method timed once a round, ``warmup`` rounds untimed then ``repeats`` timed; the order rotates every
    round (``rotate``) so that a drift in load hits every method alike. ``before(name)`` and ``after(name)`` run
    untimed around each call; ``sync()`` (a barrier in a job) runs just before the clock starts and just before it
    stops. Returns the timed seconds per method."""
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before(name)
            if sync is not None:
                sync()
            start = time.perf_counter()
            methods[name]()
            if sync is not None:
                sync()
            elapsed = time.perf_counter() - start
            if after is not None:
                after(name)
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


def in_child(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """``fn()`` in a forked child: ``(seconds, peak RSS growth in bytes, its picklable result)``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, leave without running the parent's cleanup
        os.close(read)
        try:
            import torch

            torch.set_num_threads(1)  # an OpenMP pool does not survive fork; one thread, like every floor here
            # A forked child inherits its parent's peak (ru_maxrss too): reset it, measure from here.
            Path("/proc/self/clear_refs").write_text("5")
            start_rss = status_bytes("VmRSS")
            t0 = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - t0
            payload = pickle.dumps(("ok", seconds, max(status_bytes("VmHWM") - start_rss, 0), result))
        except BaseException as exc:  # reported to the parent, which raises it
            payload = pickle.dumps(("error", 0.0, 0, repr(exc)))
        with os.fdopen(write, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        status, seconds, peak, result = pickle.loads(f.read())
    os.waitpid(pid, 0)
    if status != "ok":
        raise RuntimeError(f"measured operation failed: {result}")
    return seconds, peak, result


def fresh(module: str, *args: Any) -> dict[str, Any]:
    """``python -m module --measure *args`` in a fresh interpreter (from the repository root); its last line's JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", module, "--measure", *map(str, args)], capture_output=True, text=True, env=env, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{module} --measure {' '.join(map(str, args))}: exited {done.returncode}: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def reply(**fields: Any) -> None:
    """What a ``--measure`` run prints for :func:`fresh`: one JSON line."""
    print(json.dumps(fields))


def spawn_gloo(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes, a gloo group initialised in each."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_gloo, args=(world_size, port, fn, args), nprocs=world_size, start_method="spawn")


def _gloo(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def adam_full_dict(shapes: dict[str, tuple[int, ...]], world_size: int, *, step: float = 7.0, **group: Any) -> dict[str, Any]:
    """Our full dict of a synthetic Adam state: random ``exp_avg`` / ``exp_avg_sq`` of each named shape, ``step``."""
    import torch

    from fsdp_optim.formats.fullstate import FORMAT_KEY

    g = torch.Generator().manual_seed(0)
    state = {
        i: {"step": torch.tensor(step), "exp_avg": torch.randn(shape, generator=g), "exp_avg_sq": torch.rand(shape, generator=g)}
        for i, shape in enumerate(shapes.values())
    }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), **group, "params": list(range(len(shapes)))}]
    meta = {"version": 1, "optimizer": "Adam", "world_size": world_size, "scalar_keys": ["step"]}
    return {"state": state, "param_groups": groups, "param_names": dict(enumerate(shapes)), FORMAT_KEY: meta}


def layers(count: int, dim: int) -> dict[str, tuple[int, ...]]:
    """``layers.{i}.weight`` of ``dim x dim``, ``count`` of them."""
    return {f"layers.{i}.weight": (dim, dim) for i in range(count)}


def fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_durably(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path``, flushed and fsync-ed (what every floor and offline writer here pays)."""
    import torch

    path = Path(path)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return path
