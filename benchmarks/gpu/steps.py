"""One bounded step of ``.ci/gpu-check`` (:mod:`benchmarks.gpu.check`) and a phase of them run at once.

Each step runs under ``timeout -k 5 <seconds>`` (which signals the step's whole process group: torchrun's ranks,
pytest's workers), its output read line by line as it comes: printed at once with the step's name in front, and
kept in the run's log and in the step's own file. An interrupt of the runner (SIGINT, or SIGTERM turned into one)
terminates every running step before it goes on.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

TAIL_LINES = 40
TAIL_CHARS = 6000
KILL_AFTER_S = 5


@dataclass(frozen=True)
class Step:
    """A command, its bound in seconds, environment additions, and a line its output must hold (``expect``)."""

    name: str
    argv: tuple[str, ...]
    timeout_s: int
    env: tuple[tuple[str, str], ...] = ()
    expect: str = ""
    stop_signal: str = "TERM"  # what its bound sends first (INT: pytest writes its XML with the tests that ended)

    def not_run(self, why: str) -> dict[str, Any]:
        return {"name": self.name, "command": " ".join(self.argv), "status": "not run", "rc": None, "seconds": 0.0,
                "tail": why, "log": None, "log_lines": []}  # fmt: skip


def _pump(stream: IO[str], name: str, lines: list[str], sinks: list[IO[str]], lock: threading.Lock, ended: list[float]) -> None:
    """Every line of ``stream`` to the console, ``sinks`` and ``lines``; when it closes (the step ended), the time."""
    for line in stream:
        lines.append(line.rstrip("\n"))
        with lock:
            print(f"[{name}] {line}", end="", flush=True)
            for sink in sinks:
                sink.write(f"[{name}] {line}")
                sink.flush()
    ended.append(time.monotonic())


def _status(step: Step, rc: int, lines: list[str]) -> str:
    if rc in (124, 137, -9, -15, -2):
        return "timed out"
    if rc != 0:
        return "failed"
    if step.expect and not any(line.startswith(step.expect) for line in lines):
        return f"failed: no line starting {step.expect!r}"
    return "passed"


def run_phase(steps: list[Step], tmp: Path, log: IO[str], left_s: float) -> dict[str, dict[str, Any]]:
    """Start every step of the phase, each bounded by ``min(its timeout, left_s)``; wait for all; their outcomes."""
    lock = threading.Lock()
    running = []
    for step in steps:
        bound = max(1, int(min(step.timeout_s, left_s - 2)))
        path = tmp / f"{step.name.replace(' ', '_').replace('=', '')}.log"
        own = open(path, "w")  # noqa: SIM115 - closed below, once the step's output has ended
        lines: list[str] = []
        ended: list[float] = []
        proc = subprocess.Popen(["timeout", "-s", step.stop_signal, "-k", str(KILL_AFTER_S), str(bound), *step.argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=os.environ | dict(step.env), bufsize=1)  # fmt: skip
        assert proc.stdout is not None, "the step's output is a pipe"
        pump = threading.Thread(target=_pump, args=(proc.stdout, step.name, lines, [log, own], lock, ended), daemon=True)
        pump.start()
        print(f"[{step.name}] started, bound {bound} s: {' '.join(step.argv)}", flush=True)
        running.append((step, proc, pump, own, lines, ended, path, time.monotonic(), bound))
    outcomes: dict[str, dict[str, Any]] = {}
    try:
        for step, proc, pump, own, lines, ended, path, started, bound in running:
            rc = proc.wait()
            pump.join(timeout=10)
            own.close()
            seconds = (ended[0] if ended else time.monotonic()) - started  # its own end, not the phase's
            status = _status(step, rc, lines)
            tail = "\n".join(lines[-TAIL_LINES:])[-TAIL_CHARS:]
            outcomes[step.name] = {"name": step.name, "command": " ".join(step.argv), "status": status, "rc": rc,
                                   "seconds": round(seconds, 1), "bound_s": bound, "tail": tail, "log": str(path),
                                   "log_lines": lines}  # fmt: skip
            print(f"[{step.name}] {status} (rc {rc}) in {seconds:.1f} s", flush=True)
    except BaseException:
        for _, proc, *_ in running:
            if proc.poll() is None:
                proc.terminate()  # timeout passes it on to the step's process group
        for _, proc, *_ in running:
            try:
                proc.wait(timeout=KILL_AFTER_S + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    return outcomes
