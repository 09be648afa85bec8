"""Ctrl-C in ``fsdp-optim``: one line, exit 130, the output left as it was.

A sharded checkpoint of about 190 MB is made offline (``reshard`` of a full dict onto a 2-rank layout built
here), large enough that writing a copy takes most of a second. Each case starts the CLI in a fresh
interpreter, waits until the writer's lock or staging entry appears beside the output, and sends SIGINT.
Before, ``convert --to dcp`` printed torch's ``RuntimeError: [enforce fail at inline_container.cc]`` with its
traceback and ``reshard`` / ``consolidate`` a raw ``KeyboardInterrupt`` traceback. Now each prints one line
starting with ``interrupted`` and exits 130, and the output is absent (or, if it existed, byte for byte as it
was), with no staging or temporary file left.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fsdp_optim
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec

ROOT = Path(__file__).resolve().parents[1]
ROWS, COLS = 24_000, 1000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    big = {"step": torch.tensor(3.0), "exp_avg": torch.randn(ROWS, COLS, generator=g),
           "exp_avg_sq": torch.rand(ROWS, COLS, generator=g)}  # fmt: skip
    small = {"step": torch.tensor(3.0), "exp_avg": torch.randn(7, generator=g), "exp_avg_sq": torch.rand(7, generator=g)}
    full = {
        "state": {0: big, 1: small},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "params": [0, 1]}],
        "param_names": {0: "big.weight", 1: "small.bias"},
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 1, "scalar_keys": ["step"]},
    }
    specs = (ParamSpec("big.weight", (ROWS, COLS), 0), ParamSpec("small.bias", (7,), ROWS * COLS))
    layout = ModelLayout((FlatParamLayout("", specs, 2, 0, torch.float32, False),), ("big.weight", "small.bias"), 2, 0)
    out = tmp_path_factory.mktemp("interrupt") / "ckpt"
    fsdp_optim.reshard(full, 2, out, layout=layout)
    return out


def _interrupt(argv: list[str], watch: Path, before: set[str]) -> subprocess.CompletedProcess:
    """Run the CLI, SIGINT it once its staging directory or temporary file is in ``watch`` (mid-write)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_optim", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + 120
    while proc.poll() is None and not _new(watch, before) and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(0.05)  # into the write
    assert proc.poll() is None, f"{argv}: finished before it could be interrupted: {proc.communicate()}"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _new(watch: Path, before: set[str]) -> set[str]:
    """Entries of ``watch`` that were not there, but the lock file (which stays, empty, between writers)."""
    return {n for n in set(os.listdir(watch)) - before if not n.endswith(".lock")}


@pytest.mark.parametrize(
    "verb, existing",
    [("consolidate", False), ("consolidate", True), ("reshard", False), ("convert-dcp", False)],
)
def test_ctrl_c_prints_one_line_exits_130_and_leaves_the_output_as_it_was(ckpt, tmp_path, verb, existing) -> None:
    outs = tmp_path / "outs"
    outs.mkdir()
    target = outs / ("full.pt" if verb == "consolidate" else "out")
    if existing:
        target.write_bytes(b"the previous output")
    argv = {
        "consolidate": ["consolidate", str(ckpt), "-o", str(target), *(["--overwrite"] if existing else [])],
        "reshard": ["reshard", str(ckpt), "--world-size", "3", "-o", str(target)],
        "convert-dcp": ["convert", str(ckpt), "--to", "dcp", "-o", str(target)],
    }[verb]
    before = set(os.listdir(outs))
    done = _interrupt(argv, outs, before)
    lines = done.stderr.splitlines()
    assert done.returncode == 130, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("interrupted; "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout == "", (done.stdout, done.stderr)
    assert str(target) in lines[0], lines
    if existing:
        assert target.read_bytes() == b"the previous output" and "left as it was" in lines[0], lines
    else:
        assert not os.path.lexists(target) and "nothing was written" in lines[0], lines
    left = _new(outs, before)
    assert not left, f"staging or temporary files left: {sorted(left)}"


FIXTURE = ROOT / "tests" / "fixtures" / "v2_adam_w2"
# The program as the console script runs it, with a real Ctrl-C (SIGINT to itself) right after main() returned:
# the output written and reported, the interpreter about to exit.
_AFTER_MAIN = (
    "import os, signal, sys, time\n"
    "from fsdp_optim.cli import main\n"
    "code = main()\n"
    "os.kill(os.getpid(), signal.SIGINT)\n"
    "time.sleep(0.2)\n"
    "sys.exit(code)\n"
)


def test_ctrl_c_after_the_work_is_reported_does_not_turn_it_into_a_silent_130(tmp_path) -> None:
    out = tmp_path / "full.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _AFTER_MAIN, "consolidate", str(FIXTURE / "ckpt"), "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert done.stdout.startswith(f"wrote {out}") and done.stderr == "", (done.stdout, done.stderr)
    assert torch.load(out, weights_only=True)["fsdp_optim"]["world_size"] == 2


class _InterruptedAfterFirstLine(io.StringIO):
    """stdout whose first line written is followed by a real SIGINT to this process (a Ctrl-C while the report of
    finished work is being printed)."""

    def write(self, text: str) -> int:
        n = super().write(text)
        if "\n" in text and not getattr(self, "sent", False):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return n


def test_ctrl_c_while_the_report_is_printed_exits_0_with_the_whole_report(tmp_path, capsys, monkeypatch) -> None:
    from fsdp_optim.cli import main

    stdout = _InterruptedAfterFirstLine()
    monkeypatch.setattr(sys, "stdout", stdout)
    code = main(["verify", str(FIXTURE / "ckpt")])
    assert code == 0, stdout.getvalue()
    assert getattr(stdout, "sent", False) and stdout.getvalue().splitlines()[-1].startswith("verified: ")
    assert capsys.readouterr().err == ""
