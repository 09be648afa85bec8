"""The demo (``torchrun ... -m fsdp_optim.demo``) leaves nothing in the temp dir when no ``--out`` was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_removes_its_temporary_directory(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "fsdp_optim.demo", "--steps", "1", "--repeats", "1"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "continuity verified" in done.stdout, done.stdout[-2000:]
    left = sorted(p.name for p in tmp_path.glob("fsdp_optim_demo_*"))
    assert not left, f"the demo left {left} in the temp dir"
