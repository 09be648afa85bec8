"""What a user's own job did wrong, run as that job: one interpreter per rank, started as torchrun starts them
(``tests/_user_job.py``), in one process group of their own so a Ctrl-C reaches every rank.

- An async save whose process group is destroyed before ``wait()`` is never lost in silence: the checkpoint is
  complete, or every rank prints what was lost and exits non-zero (it exited 0 with an empty directory).
- What a save interrupted by Ctrl-C left (rank and side files no journal names) is recognised as ours: verify names
  it, the next save removes it (it was kept, as foreign, for ever); a Ctrl-C to the whole job ends in one whole
  checkpoint once the job saves again.
- A save called on one rank alone says that every rank must call it.
- The memory tier warns when a replica would sit on the node it should outlive, and ``clear_memory()`` removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import _models as M
import pytest
from _dist import free_port, run_ranks

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.formats.sharded.reader import open_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 300  # the ranks' own collectives time out well before
CHECK_IN = "FSDP_OPTIM_CHECK_IN_S"


def start_job(
    scenario: str, directory: Path, world_size: int = 2, env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    """``world_size`` ranks of ``tests/_user_job.py``, all in one new process group (the first rank's pid)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
           **(env or {})}  # fmt: skip
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


def _save_twice(rank: int, world_size: int, first: str, second: str) -> None:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    M.train_step(model, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(model, optim, first, extra={"step": 1})
    fsdp_optim.save_checkpoint(model, optim, second, extra={"step": 2})


def _save_over(rank: int, world_size: int, directory: str) -> None:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    M.train_step(model, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(model, optim, directory, extra={"step": 3}, overwrite=True)


def _files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_an_interrupted_saves_leftovers_are_ours_reported_and_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files a save interrupted on one rank left beside a committed checkpoint (no journal names them any more):
    verify names them as leftovers, and the next save removes them (it kept them as foreign before)."""
    first, second = tmp_path / "first", tmp_path / "second"
    run_ranks(_save_twice, 2, str(first), str(second))
    side = next(n for n in _files(first) if n.startswith("train-") and "rank00001" in n)
    shutil.copy2(first / side, second / side)  # what the interrupted save left: a real side file of another save
    report = fsdp_optim.verify(second)
    assert report.ok, report.lines()
    assert any(line.startswith(f"{side}: leftover of an interrupted save") for line in report.lines()), report.lines()
    assert main(["verify", str(second)]) == 0
    out = capsys.readouterr().out
    assert "verified: 5 files, every one present, of its size, checksums matching; 1 leftover file(s)" in out, out
    run_ranks(_save_over, 2, str(second))
    assert side not in _files(second), f"the next save kept the leftover: {sorted(_files(second))}"
    assert fsdp_optim.verify(second).ok and not any("leftover" in x for x in fsdp_optim.verify(second).lines())


def test_ctrl_c_during_a_save_leaves_one_outcome_and_no_leftovers(tmp_path: Path) -> None:
    """SIGINT to the job's process group while it saves in a loop: the ranks agree on what became of the save (it
    finishes as agreed, then raises: before, one rank said done and the other raised, or hung in a collective), the
    next save (overwrite=True) leaves exactly one whole checkpoint, and no rank reports a bare EOFError."""
    directory = tmp_path / "ckpt"
    ranks = start_job("interrupted", directory)
    deadline = time.monotonic() + DEADLINE_S
    while not (directory / "manifest.json").exists() or len(_files(directory)) < 6:  # mid-way through a save
        assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), "the job never saved"
        time.sleep(0.005)
    os.killpg(ranks[0].pid, signal.SIGINT)
    results = finish(ranks)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0 and f"rank {rank}: after ok" in out, f"rank {rank} ({code}): {out}\n{err[-3000:]}"
        assert "EOFError" not in err, f"rank {rank}: {err[-3000:]}"
    outcomes = [[line.split(": ", 1)[1] for line in out.splitlines() if "outcome" in line] for _, out, _ in results]
    assert outcomes[0] == outcomes[1] and len(outcomes[0]) == 1, f"the ranks disagree: {outcomes}"
    report = fsdp_optim.verify(directory)
    assert report.ok and not any("leftover" in line for line in report.lines()), report.lines()
    manifest = open_checkpoint(directory).manifest
    assert _files(directory) == {"manifest.json"} | manifest.file_names(), sorted(_files(directory))


def _memory_job(rank: int, world_size: int, root: str, memory: str) -> dict:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    manager = fsdp_optim.CheckpointManager(root, every=10, keep=1, memory_every=1, replicas=1, memory_dir=memory)
    M.train_step(model, optim, *M.local_batch(0, rank, world_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1, model, optim)
        manager.wait()
    held = sorted(p.name for p in Path(memory).rglob("*") if p.is_file())
    removed = manager.clear_memory()
    return {"warned": [str(w.message) for w in caught], "held": held, "removed": [str(p) for p in removed]}


def test_the_memory_tier_warns_of_a_replica_on_the_same_node_and_clears_its_memory(tmp_path: Path) -> None:
    """Two ranks on one node with replicas=1: rank 0 warns that the replica shares the node (it was silent); then
    ``clear_memory()`` on every rank leaves nothing in the memory directory (there was no way to clear it)."""
    memory = Path("/dev/shm") / f"fsdp_optim-test-{uuid.uuid4().hex[:12]}"
    try:
        results = run_ranks(_memory_job, 2, str(tmp_path / "durable"), str(memory))
        assert results[0]["held"], "the memory tier held nothing to clear"
        warned = [w for w in results[0]["warned"] if "replicas=1, but every rank is on node" in w]
        assert len(warned) == 1, results[0]["warned"]
        assert not any("replicas=" in w for w in results[1]["warned"]), "said once, by rank 0"
        assert not memory.exists(), f"left in memory: {sorted(p.name for p in memory.rglob('*'))}"
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def test_a_save_called_on_rank_0_alone_says_every_rank_must_call_it(tmp_path: Path) -> None:
    """Rank 0 calls save_checkpoint, rank 1 does not: rank 0 raises saying that every rank must call it (it died of
    gloo's "Connection closed by peer", or a C++ abort when rank 1 was in another collective)."""
    directory = tmp_path / "ckpt"
    (code0, out0, err0), (code1, out1, err1) = finish(start_job("rank0-only", directory, env={CHECK_IN: "20"}))
    assert code0 != 0 and "every rank must call it, but only 1 of the 2 ranks did" in out0, f"{out0}\n{err0[-3000:]}"
    assert code1 == 0 and "rank 1: not saving" in out1, f"{out1}\n{err1[-3000:]}"
    assert not directory.exists() or not list(directory.iterdir()), "nothing was to be written"
