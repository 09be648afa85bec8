"""What a user's own job did wrong, run as that job: one interpreter per rank, started as torchrun starts them
(``tests/_user_job.py``), in one process group of their own so a Ctrl-C reaches every rank.

- An async save whose process group is destroyed before ``wait()`` is never lost in silence: the checkpoint is
  complete, or every rank prints what was lost and exits non-zero (it exited 0 with an empty directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _dist import free_port

import fsdp_optim

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 300  # the ranks' own collectives time out well before


def start_job(scenario: str, directory: Path, world_size: int = 2) -> list[subprocess.Popen[str]]:
    """``world_size`` ranks of ``tests/_user_job.py``, all in one new process group (the first rank's pid)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size)}  # fmt: skip
    ranks: list[subprocess.Popen[str]] = []
    for rank in range(world_size):
        ranks.append(subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_user_job.py"), scenario, str(directory)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, process_group=ranks[0].pid if ranks else 0,
        ))  # fmt: skip
    return ranks


def finish(ranks: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Each rank's (exit status, stdout, stderr); a rank still running at the deadline is killed."""
    done = []
    try:
        for rank in ranks:
            out, err = rank.communicate(timeout=DEADLINE_S)
            done.append((rank.returncode, out, err))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    return done


def test_an_async_save_under_a_destroyed_group_is_never_lost_in_silence(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    results = finish(start_job("lost", directory))
    if all(code == 0 for code, _, _ in results):  # it committed after all: then it must be whole
        assert fsdp_optim.verify(directory).ok, "exit 0 but the checkpoint does not verify"
        return
    for rank, (code, out, err) in enumerate(results):
        assert code != 0, f"rank {rank} exited 0 while another failed: {out}\n{err[-3000:]}"
        assert f"into {directory} FAILED and nobody called wait()" in err, f"rank {rank}: {err[-3000:]}"
        assert "destroy_process_group" in err, f"rank {rank} does not say why: {err[-3000:]}"
    assert not list(directory.glob("manifest*")), "a failed save committed a manifest"
