"""``fsdp-optim`` under a real ``torchrun`` of 2 processes. Given input it refuses, process 0 alone says why, on one
line, and every process exits with the same code; the launcher's own report (it prints one for any failed process)
names that line as the failure, not a traceback hint. A program that runs several verbs in one process gets every
one of them done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("FSDP_OPTIM_ALONE", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    program = ["-m", "fsdp_optim"] if not argv[0].endswith(".py") else []
    return subprocess.run([*launcher, *program, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)  # fmt: skip


def test_verbs_run_one_after_another_in_one_process(tmp_path: Path) -> None:
    """Each verb joins the team and leaves it; the next one must not dial what the last one closed."""
    program = tmp_path / "verbs.py"
    program.write_text(
        "import sys\n"
        "from fsdp_optim.cli import main\n"
        "codes = [main([verb, sys.argv[1]]) for verb in ('verify', 'inspect', 'verify', 'verify')]\n"
        "print('codes', codes)\n"
        "sys.exit(max(codes))\n"
    )
    done = _torchrun(str(program), str(ROOT / "tests" / "fixtures" / "v3_adam_w2" / "ckpt"))
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.count("codes [0, 0, 0, 0]") == 2, done.stdout[-2000:]


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_refused_input_is_said_once_by_process_0(tmp_path: Path, verb: str) -> None:
    missing = tmp_path / "no-such-checkpoint"
    done = _torchrun(verb, str(missing))
    said = [line for line in done.stderr.splitlines() if line.startswith("fsdp-optim: error:")]
    assert len(said) == 1, f"expected one error line, found {len(said)}:\n{done.stderr[-4000:]}"
    assert str(missing) in said[0] and "no such file or directory" in said[0], said
    assert "[raised on rank" not in said[0], f"process 0 says its own error: {said}"
    assert done.returncode == 1, done.returncode
    assert done.stdout == "", done.stdout
    report = [line for line in done.stderr.splitlines() if line.strip().startswith("traceback :")]
    assert report and all("fsdp-optim: error:" in line for line in report), f"the launcher's report: {report}"
