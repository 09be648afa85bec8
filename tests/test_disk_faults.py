"""Saving survives faults: SIGKILL at random points, and a full disk (the on-disk half).

Jobs here are real: fairscale FSDP over a gloo group, real optimizer steps, real files, killed with a
real ``SIGKILL`` or stopped by a real full file system. Nothing is mocked.

**SIGKILL campaign.** A job trains and saves into one directory again and again, announcing on a pipe
the digest (:func:`fsdp_optim.manifest.digest`) of the full dict it is about to save ("begin") and
that the save returned ("done"). The test kills the whole job with ``SIGKILL`` a random delay after a
randomly chosen "begin", spread over the time a save takes, so kills land while rank files, their
temporary names, the manifest or the clean-up of the previous save are being written. After every
kill the directory must consolidate offline with every checksum verified, and equal either the last
save the job reported done or the one it was in the middle of: never an older one, never a mix. The
next trial's job starts by loading the directory (a resumed job), reports what it loaded, and must
have loaded exactly that. ``FSDP_OPTIM_FAULT_TRIALS`` (default 20) sets the number of trials;
``FSDP_OPTIM_FAULT_SEED`` the seed (printed in every failure); the world-size-2 campaign runs only when
``FSDP_OPTIM_FAULT_TRIALS`` is set.

**Full disk.** A world-size-2 job saves a checkpoint into a small tmpfs that the test mounts, then
takes a step and saves again; the second save does not fit. Every rank must raise, the optimizer must
be unchanged, the directory must still hold the first checkpoint (manifest and rank files byte for
byte) and the job must load it back exactly; once space is back, the next save succeeds and clears the
debris. Where mounting is not allowed (no root), the same job runs with ``RLIMIT_FSIZE`` set in the
ranks (``SIGXFSZ`` ignored), so writes fail with ``EFBIG`` instead; a warning says so.

Jobs are started from a ``multiprocessing`` forkserver that has already imported torch, fairscale and
this module: a trial costs a fork, not a fresh interpreter (seconds each on a loaded 2-core machine),
which is why these tests do not go through ``_dist.run_ranks``. Each rank joins a gloo group through a
file store of its own job, so a killed job leaves nothing behind that the next one could trip over.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from _checks import assert_identical, snapshot
from _dist import forkserver_context
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim import consolidate, load_sharded_optim_state, save_sharded_optim_state
from fsdp_optim.core.checksums import digest
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import open_checkpoint

TRIALS = int(os.environ.get("FSDP_OPTIM_FAULT_TRIALS", "20"))
SEED = int(os.environ.get("FSDP_OPTIM_FAULT_SEED", "5"))
LONG_CAMPAIGN = "FSDP_OPTIM_FAULT_TRIALS" in os.environ
COLLECTIVE_TIMEOUT_S = 30
MESSAGE_TIMEOUT_S = 120  # a job silent this long is stuck: the test fails instead of hanging
# What the forkserver imports once, so that a job's ranks start in milliseconds. torch._dynamo is what
# the first optimizer constructor imports: seconds, the largest part of a fresh rank's start.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "fairscale.nn", "fsdp_optim", "_models", __name__]


# ---------------------------------------------------------------------------------------------------
# Jobs: ranks forked from a preloaded forkserver, one pipe per rank back to the test


def _context() -> Any:
    return forkserver_context(PRELOAD)


def _rank_main(fn: Callable[..., None], rank: int, world_size: int, store: str, conn: Connection, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        fn(rank, world_size, conn, *args)
        conn.send(("exit", rank))
    except BaseException:  # noqa: BLE001 - every failure goes to the test, which reports it
        conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Job:
    processes: list[Any]
    conns: list[Connection]  # the test's ends, one per rank
    received: list[tuple] = field(default_factory=list)  # (rank, message) in arrival order

    def next_message(self, timeout_s: float = MESSAGE_TIMEOUT_S) -> tuple[int, tuple]:
        """The next message of any rank; fails on an error report or when the job stays silent."""
        ready = wait(self.conns, timeout=timeout_s)
        if not ready:
            self.kill()
            raise AssertionError(f"the job sent nothing for {timeout_s}s; got so far: {self.received}")
        conn = ready[0]
        rank = self.conns.index(conn)
        try:
            message = conn.recv()
        except EOFError:
            self.conns.remove(conn)
            raise AssertionError(f"rank {rank} died without a word; got so far: {self.received}") from None
        self.received.append((rank, message))
        if message[0] == "error":
            self.kill()
            raise AssertionError(message[1])
        return rank, message

    def kill(self) -> None:
        """SIGKILL every rank at once, then collect what they had sent before dying."""
        for process in self.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:  # it finished between the check and the signal: nothing to kill
                    pass
        for process in self.processes:
            process.join()
        for conn in self.conns:
            while True:
                try:
                    if not conn.poll():
                        break
                    self.received.append((self.conns.index(conn), conn.recv()))
                except (EOFError, OSError):
                    break
            conn.close()

    def join(self) -> None:
        """Wait for every rank to report a clean exit."""
        exited = 0
        while exited < len(self.processes):
            _, message = self.next_message()
            exited += message[0] == "exit"
        for process in self.processes:
            process.join()
        for conn in self.conns:
            conn.close()


def start_job(fn: Callable[..., None], world_size: int, workdir: Path, *args: Any) -> Job:
    """Run ``fn(rank, world_size, conn, *args)`` on ``world_size`` forked ranks joined in a gloo group."""
    ctx = _context()
    store = tempfile.mktemp(prefix="store-", dir=workdir)  # the FileStore creates it
    processes, conns = [], []
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_rank_main, args=(fn, rank, world_size, store, writer, args), daemon=True)
        process.start()
        writer.close()
        processes.append(process)
        conns.append(reader)
    return Job(processes, conns)


# ---------------------------------------------------------------------------------------------------
# The SIGKILL campaign


def _save_repeatedly(rank: int, world_size: int, conn: Connection, directory: str, max_saves: int) -> None:
    """Resume from ``directory`` if it holds a checkpoint, then train and save into it, over and over."""
    model = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(model))
    if (Path(directory) / MANIFEST_NAME).exists():
        load_sharded_optim_state(model, optim, directory)
        full = model.gather_full_optim_state_dict(optim)
        if rank == 0:
            conn.send(("loaded", digest(full)))
    for k in range(1, max_saves + 1):
        M.train_step(model, optim, *M.local_batch(k, rank, world_size))
        full = model.gather_full_optim_state_dict(optim)
        if rank == 0:
            conn.send(("begin", k, digest(full)))
        start = time.perf_counter()
        save_sharded_optim_state(model, optim, directory)
        if rank == 0:
            conn.send(("done", k, time.perf_counter() - start))


_TEMP = re.compile(r"^\..*\.tmp\.\d+\.[0-9a-f]+$")  # disk.atomic's temporary names


def _verify(directory: Path) -> str:
    """Consolidate (every unit's checksum verified) and read every rank file whole; the state's digest."""
    full = consolidate(directory)
    with open_checkpoint(directory, lazy=False) as ckpt:
        for record in ckpt.manifest.files:
            ckpt.load_rank(record.rank)
    return digest(full)


def _where_it_died(directory: Path, before: set[str], committed: bool) -> str:
    """Where a kill landed, as the directory tells it (``before``: its listing before the job started)."""
    names = set(os.listdir(directory))
    new = names - before
    if committed:
        return (
            "after the new manifest, before the old files were removed"
            if before & names - {MANIFEST_NAME}
            else ("after the save and its clean-up")
        )
    if any(_TEMP.match(n) and MANIFEST_NAME in n for n in new):
        return "while writing the manifest"
    if any(_TEMP.match(n) for n in new):
        return "while writing a rank file"
    return "between the rank files and the manifest" if new else "before the save wrote anything"


def _campaign(world_size: int, trials: int, seed: int, workdir: Path) -> Counter[str]:
    """Kill a saving job ``trials`` times; after each kill check the directory and resume from it."""
    rng = random.Random(seed)
    directory = workdir / "ckpt"
    on_disk: str | None = None  # digest of the checkpoint in the directory, verified
    save_seconds = [0.05]  # how long saves took, as the jobs measured them
    landed: Counter[str] = Counter()
    for trial in range(trials):
        # Kill a random fraction of a save's duration after the announcement of save n; the first
        # trial lets one save complete, so that there is a previous checkpoint to lose.
        n = rng.randint(1 if on_disk else 2, 3)
        delay = rng.uniform(0.0, 1.25) * statistics.median(save_seconds)
        context = (
            f"seed {seed} (FSDP_OPTIM_FAULT_SEED), world size {world_size}, trial {trial}: "
            f"killed {delay * 1e3:.1f} ms after save {n} began"
        )
        before = set(os.listdir(directory)) if directory.exists() else set()
        job = start_job(_save_repeatedly, world_size, workdir, str(directory), n + 5)
        try:
            while (message := job.next_message()[1])[:2] != ("begin", n):
                assert message[0] != "exit", "the job finished before it was killed"
        except AssertionError as exc:  # a rank failed or went silent: say which trial
            raise AssertionError(f"{context}: {exc}") from exc
        time.sleep(delay)
        job.kill()
        messages = [m for rank, m in job.received if rank == 0]
        loaded = [m[1] for m in messages if m[0] == "loaded"]
        began = {m[1]: m[2] for m in messages if m[0] == "begin"}
        done = [m[1] for m in messages if m[0] == "done"]
        save_seconds += [m[2] for m in messages if m[0] == "done"]

        if on_disk is not None:
            assert loaded == [on_disk], f"{context}: the job resumed from {loaded}, the directory held {on_disk}"
        last_done = began[max(done)] if done else on_disk
        in_flight = began[max(began)] if max(began) not in done else None
        try:
            found = _verify(directory)
        except Exception as exc:
            raise AssertionError(f"{context}: the directory holds no valid checkpoint: {exc}") from exc
        assert found in (last_done, in_flight), (
            f"{context}: the directory holds {found}, neither the last completed save ({last_done}) nor the one "
            f"in flight ({in_flight}); saves begun: {began}, done: {done}"
        )
        landed[_where_it_died(directory, before, committed=found == in_flight)] += 1
        on_disk = found
    # A last job resumes from what the campaign left, saves once and leaves the directory clean.
    job = start_job(_save_repeatedly, world_size, workdir, str(directory), 1)
    job.join()
    messages = [m for rank, m in job.received if rank == 0]
    assert [m[1] for m in messages if m[0] == "loaded"] == [on_disk], (
        f"seed {seed}: the last job resumed from something else"
    )
    assert _verify(directory) == next(m[2] for m in messages if m[0] == "begin"), f"seed {seed}: the last save"
    names = set(os.listdir(directory))
    assert names == {MANIFEST_NAME} | {f.file for f in read_manifest(directory).files}, (
        f"seed {seed}: left {sorted(names)}"
    )
    print(f"\n{trials} SIGKILL trials at world size {world_size}, seed {seed}, where the kills landed: {dict(landed)}")
    return landed


def test_sigkill_while_saving_never_loses_the_previous_checkpoint(tmp_path: Path) -> None:
    _campaign(1, TRIALS, SEED, tmp_path)


@pytest.mark.skipif(not LONG_CAMPAIGN, reason="set FSDP_OPTIM_FAULT_TRIALS=N to run the world-size-2 campaign")
def test_sigkill_while_saving_at_world_size_2(tmp_path: Path) -> None:
    _campaign(2, TRIALS, SEED + 1, tmp_path)


# ---------------------------------------------------------------------------------------------------
# A write that fails: a full disk, or one rank's file over its size limit

# One FSDP unit of 512 x 512 + 512 parameters with Adam: each rank file of a world-size-2 save holds
# about 1 MiB, a checkpoint about 2 MiB. The small file system holds one checkpoint, not a second.
SMALL_DISK = "2560k"
FILE_LIMIT = 64 << 10  # RLIMIT_FSIZE where the disk is simulated: any rank file is larger


def _big_model() -> FSDP:
    torch.manual_seed(0)
    return FSDP(nn.Sequential(FSDP(nn.Linear(512, 512)), nn.Linear(512, 4)))


def _big_step(model: FSDP, optim: torch.optim.Optimizer, step: int, rank: int) -> None:
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(100 * step + rank))
    optim.zero_grad()
    model(x).pow(2).sum().backward()
    optim.step()


def _gathered_digest(model: FSDP, optim: torch.optim.Optimizer) -> str | None:
    full = model.gather_full_optim_state_dict(optim)
    return None if full is None else digest(full)


def _write_fails(
    rank: int, world_size: int, conn: Connection, directory: str, phase: str, limited: tuple[int, ...]
) -> None:
    """``first``: train, save. ``fail``: resume, train, save with writes failing. ``retry``: resume, train, save."""
    model = _big_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    if phase != "first":
        load_sharded_optim_state(model, optim, directory)
        conn.send(("loaded", _gathered_digest(model, optim)))
    _big_step(model, optim, 0 if phase == "first" else 1, rank)
    if phase != "fail":
        save_sharded_optim_state(model, optim, directory)
        conn.send(("saved", _gathered_digest(model, optim)))
        return
    before = snapshot(optim.state_dict())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank in limited:  # a write past the limit fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
    try:
        save_sharded_optim_state(model, optim, directory)
        raised = None
    except Exception as exc:  # noqa: BLE001 - the test looks at what it is
        raised = (type(exc).__name__, str(exc))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        assert_identical(snapshot(optim.state_dict()), before, "optimizer state")
        changed = None
    except AssertionError as exc:
        changed = str(exc)
    # The job goes on: what the directory holds loads into a fresh optimizer.
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    load_sharded_optim_state(model, fresh, directory)
    conn.send(("failed", raised, changed, _gathered_digest(model, fresh)))


def _tree(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``directory``: name -> (size, mtime in ns, bytes)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _mount_small_disk(mountpoint: Path) -> str | None:
    """Mount a tmpfs of ``SMALL_DISK`` at ``mountpoint``; the reason when that is not allowed here."""
    mountpoint.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited with {done.returncode}")


def _run(world_size: int, workdir: Path, *args: Any) -> list[tuple]:
    """Run one phase of :func:`_write_fails`; every rank's messages but the exits, in arrival order."""
    job = start_job(_write_fails, world_size, workdir, *args)
    job.join()
    return [m for _, m in job.received if m[0] != "exit"]


@dataclass
class FailedWrite:
    how: str  # how the failure was produced, for messages
    saved: str  # digest of the first checkpoint, as the job gathered it
    kept: set[str]  # the first checkpoint's files
    tree_before: dict[str, tuple[int, int, bytes]]  # the directory before the failing save
    tree_after: dict[str, tuple[int, int, bytes]]  # ... and after it
    failing_job: list[tuple]  # its messages: ("loaded", digest), ("failed", raised, optimizer change, digest)
    retry_job: list[tuple]  # the job after space came back: ("loaded", digest), ("saved", digest)
    retried_files: set[str]  # the directory after that job
    retried_manifest_files: set[str]  # what its manifest names
    retried_consolidated: str


WORLD_SIZE = 2
FAILURES = {
    "the disk is full": "tmpfs",
    "one rank's file is over its size limit": "rlimit rank 1",
}


@pytest.fixture(scope="module", params=list(FAILURES))
def failed_write(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FailedWrite:
    workdir = tmp_path_factory.mktemp("failed-write")
    mountpoint = workdir / "disk"
    limited: tuple[int, ...] = (1,)
    how = "RLIMIT_FSIZE on rank 1 (EFBIG)"
    mounted = False
    if FAILURES[request.param] == "tmpfs":
        refused = _mount_small_disk(mountpoint)
        if refused is None:
            mounted, limited, how = True, (), f"a {SMALL_DISK} tmpfs (ENOSPC)"
        else:
            limited, how = tuple(range(WORLD_SIZE)), "RLIMIT_FSIZE on every rank (EFBIG)"
            warnings.warn(f"cannot mount a tmpfs ({refused}); a full disk is simulated with {how}", stacklevel=1)
    else:
        mountpoint.mkdir()
    directory = mountpoint / "ckpt"
    try:
        (saved,) = _digests(_run(WORLD_SIZE, workdir, str(directory), "first", ()), "saved")
        kept = set(os.listdir(directory))
        before = _tree(directory)
        failing = _run(WORLD_SIZE, workdir, str(directory), "fail", limited)
        after = _tree(directory)
        if mounted:  # space comes back
            subprocess.run(["mount", "-o", "remount,size=64m", str(mountpoint)], check=True, timeout=30)
        retry = _run(WORLD_SIZE, workdir, str(directory), "retry", ())
        retried_files = set(os.listdir(directory))
        retried_manifest_files = {r.file for r in read_manifest(directory).files}
        retried_consolidated = digest(consolidate(directory))
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, timeout=30)
    return FailedWrite(
        how, saved, kept, before, after, failing, retry, retried_files, retried_manifest_files, retried_consolidated
    )


def _digests(messages: list[tuple], kind: str) -> list[str]:
    """The digests the recipient (rank 0) reported in messages of ``kind``."""
    return [m[-1] for m in messages if m[0] == kind and m[-1] is not None]


def test_a_failed_write_raises_everywhere_and_keeps_the_previous_checkpoint(failed_write: FailedWrite) -> None:
    f = failed_write
    assert _digests(f.failing_job, "loaded") == [f.saved], f"{f.how}: the job resumed from something else"
    failed = [m for m in f.failing_job if m[0] == "failed"]
    assert len(failed) == WORLD_SIZE, f"{f.how}: {f.failing_job}"
    for _, raised, changed, _ in failed:
        assert raised is not None, f"{f.how}: a rank's save returned although a write failed"
        assert changed is None, f"{f.how}: a rank's optimizer changed: {changed}"
    # After the failed save, in the same job, the directory loads back to the previous checkpoint.
    assert _digests(failed, "failed") == [f.saved], f"{f.how}: the directory now loads to something else"
    # The previous checkpoint's files: the same bytes, never rewritten (same mtimes).
    assert {n: f.tree_after.get(n) for n in f.kept} == {n: f.tree_before[n] for n in f.kept}, (
        f"{f.how}: the previous checkpoint's files changed"
    )
    extra = sorted(set(f.tree_after) - f.kept)
    assert not [n for n in extra if _TEMP.match(n)], f"{f.how}: temporary files left behind: {extra}"
    assert all(n.startswith("optim-") for n in extra), f"{f.how}: unexpected files: {extra}"
    # Once space is back the next save succeeds, and clears what the failed one left.
    assert _digests(f.retry_job, "loaded") == [f.saved], f"{f.how}: {f.retry_job}"
    assert _digests(f.retry_job, "saved") == [f.retried_consolidated], f"{f.how}: {f.retry_job}"
    assert f.retried_files == f.retried_manifest_files | {MANIFEST_NAME}, f"{f.how}: {sorted(f.retried_files)}"


def test_a_failed_write_says_which_file_and_why(failed_write: FailedWrite) -> None:
    f = failed_write
    for _, (kind, message), _, _ in (m for m in f.failing_job if m[0] == "failed"):
        assert "ckpt" in message and ("No space left on device" in message or "File too large" in message), (
            f"{f.how}: a rank raised {kind}: {message}"
        )
