"""A rank SIGKILLed around ``async_save_checkpoint``: every survivor raises, soon after the kill.

Each case starts a job of real processes (one Python process per rank, a gloo group, the job's collective timeout
120 s) that trains and saves asynchronously at every step (``async_save_checkpoint``, then ``handle.wait()``). At a
seeded step after the first (the save's own gloo group exists by then), a seeded rank sends itself a real SIGKILL
at a seeded moment:

- ``before``: a seeded 0-300 ms before it calls the save (the others are on their way in, or already waiting);
- ``first collective``: at the n-th Python or C call once the save began (its check-in, where the others wait);
- ``agreements``: at the n-th call once every rank checked in (the blocking part's agreements, the save id);
- ``copy``: at the n-th call once the background thread began copying the state into host memory;
- ``write``: at the n-th call once the background thread began writing the rank file.

Every survivor must raise, from the save or from its ``wait()`` (or from the training step's own collective when
the kill came first), and the time from the kill to that raise is printed. The property is "within 10 s"; the
assertion allows :data:`MARGIN_S` for a loaded 2-core machine, far below the job's timeout.

The full campaign (60 moments: W = 2, 3; five kinds; 6 seeds each) is slow (FSDP_OPTIM_SLOW=1); the default run
takes a bounded sample of 7 (in 6 of them the victim is not rank 0, whose process holds the job's store).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

JOB_TIMEOUT_S = 120  # the job's collective timeout: a survivor that waited for it would take this long
MARGIN_S = 40.0  # what the assertion allows (the property, measured and printed, is 10 s)
DEADLINE_S = 200  # a rank still running by then is killed, and the test fails
STEPS = 4
KINDS = ("before", "first collective", "agreements", "copy", "write")
# Where each kind's counting starts: (function name, file name ending), or None for "before".
TRIGGERS = {
    "first collective": ("async_save_checkpoint", "whole_save.py"),
    "agreements": ("checkpoint_group", "async_save.py"),
    "copy": ("copy", "staging.py"),
    "write": ("write_shard_file", "writer.py"),
}
CALLS = {"before": 300, "first collective": 400, "agreements": 400, "copy": 60, "write": 300}  # moments are drawn below these


def _arm(kind: str, moment: int, killed: Path) -> None:
    """From now on, this process sends itself SIGKILL at ``moment`` (see the module docstring), first writing the
    time into ``killed``."""
    if kind == "before":
        time.sleep(moment / 1000)
        _die(killed)
    name, file = TRIGGERS[kind]
    seen = [0, False]
    lock = threading.Lock()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event not in ("call", "c_call"):
            return
        with lock:
            if event == "call" and frame.f_code.co_name == name and frame.f_code.co_filename.endswith(file):
                seen[1] = True
            if seen[1]:
                seen[0] += 1
                if seen[0] == moment:
                    _die(killed)

    threading.setprofile(profile)  # the save's background thread, started after this
    sys.setprofile(profile)


def _die(killed: Path) -> None:
    killed.write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _rank(case: dict[str, Any]) -> None:
    """One rank of a job (run as ``python test_dead_peer.py CASE_JSON``): train and save every step; the victim
    dies as armed; a survivor writes when and what it raised."""
    import _models as M
    import torch.distributed as dist

    import fsdp_optim

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(case["out"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=JOB_TIMEOUT_S))
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    outcome: dict[str, Any] = {"raised_at": None}
    try:
        for step in range(1, STEPS + 1):
            where = "train"
            M.train_step(model, optim, *M.local_batch(step - 1, rank, world_size))
            if rank == case["victim"] and step == case["step"]:
                _arm(case["kind"], case["moment"], out / "killed")
            where = "save"
            if case.get("sync"):
                fsdp_optim.save_checkpoint(model, optim, out / f"step-{step}", extra={"step": step})
            else:
                fsdp_optim.async_save_checkpoint(model, optim, out / f"step-{step}", extra={"step": step}).wait()
    except Exception as exc:
        outcome = {"raised_at": time.time(), "where": where, "step": step, "error": " ".join(str(exc).split())[:300]}
    (out / f"rank{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # the group is broken: no teardown that could wait on the dead rank


def _run_job(tmp_path: Path, world_size: int, case: dict[str, Any]) -> dict[int, dict[str, Any]]:
    from _dist import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    text = json.dumps({**case, "out": str(tmp_path)})
    processes = [
        subprocess.Popen([sys.executable, __file__, text], env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL,
                         stderr=open(tmp_path / f"rank{r}.err", "wb"))  # fmt: skip
        for r in range(world_size)
    ]
    stop_at = time.monotonic() + DEADLINE_S
    try:
        for process in processes:
            process.wait(timeout=max(1.0, stop_at - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = {}
    for r in range(world_size):
        path = tmp_path / f"rank{r}.json"
        results[r] = json.loads(path.read_text()) if path.exists() else {"missing": (tmp_path / f"rank{r}.err")}
    return results


def _cases() -> list[Any]:
    full = [(w, kind, seed) for w in (2, 3) for kind in KINDS for seed in range(6)]
    sample = {(2, "before", 3), (3, "before", 5), (3, "first collective", 2), (2, "copy", 4), (3, "write", 4),
              (3, "first collective", 1), (2, "agreements", 0)}  # fmt: skip
    return [pytest.param(*c) if c in sample else pytest.param(*c, marks=pytest.mark.slow) for c in full]


@pytest.mark.parametrize(("world_size", "kind", "seed"), _cases())
def test_a_rank_killed_around_an_async_save_fails_every_survivor_soon(
    tmp_path: Path, world_size: int, kind: str, seed: int
) -> None:
    draw = random.Random(f"{world_size}-{kind}-{seed}")
    case = {"victim": draw.randrange(world_size), "step": draw.randrange(2, STEPS), "kind": kind,
            "moment": draw.randrange(1, CALLS[kind])}  # fmt: skip
    _check_survivors(tmp_path, world_size, kind, seed, case)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_killed_before_a_sync_save_fails_every_survivor_soon(tmp_path: Path, world_size: int) -> None:
    """``save_checkpoint`` at every step; the last rank dies just before its step-3 save (the others wait in its
    check-in, which sees the dead rank through the group the first save made)."""
    case = {"victim": world_size - 1, "step": 3, "kind": "before", "moment": 100, "sync": True}
    _check_survivors(tmp_path, world_size, "sync before", 0, case)


def _check_survivors(tmp_path: Path, world_size: int, kind: str, seed: int, case: dict[str, Any]) -> None:
    results = _run_job(tmp_path, world_size, case)
    killed_file = tmp_path / "killed"
    assert killed_file.exists(), f"{case}: the victim was never killed: {results}"
    killed = float(killed_file.read_text())
    delays = {}
    for r, result in results.items():
        if r == case["victim"]:
            continue
        assert "missing" not in result, f"{case}: rank {r} left no outcome: {result['missing'].read_text()[-3000:]}"
        assert result["raised_at"] is not None, f"{case}: rank {r} finished every save without raising: {result}"
        delays[r] = result["raised_at"] - killed
    print(f"\nW={world_size} {kind} seed {seed} {case}: survivors raised after "
          + ", ".join(f"rank {r} {d:.2f} s ({results[r]['where']}: {results[r]['error'][:120]})" for r, d in delays.items()))  # fmt: skip
    slowest = max(delays.values())
    assert slowest < MARGIN_S, f"{case}: a survivor raised {slowest:.1f} s after the kill (expected within 10 s)"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _rank(json.loads(sys.argv[1]))
