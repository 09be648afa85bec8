"""Writers never destroy: concurrent writers, killed writers and stale locks, with real processes.

Every writer here is a real process forked from a preloaded forkserver (``tests/_attacks.py``): real
``reshard`` calls, real fairscale FSDP jobs on gloo saving with ``save_sharded_optim_state``, killed with
a real ``SIGKILL``. Nothing is mocked: the lock is the kernel's ``flock`` (or, with
``FSDP_OPTIM_LOCK=exclusive``, the ``O_EXCL`` lock file), the files are real files.

What must hold, whatever the interleaving: a second writer of a directory is refused at once with
``OutputLockedError`` naming the holder (or the writers serialize); every writer that reported success
left a loadable checkpoint, and the directory ends holding the checkpoint of one that did; a killed
writer leaves the previous checkpoint loadable, and the next writer removes exactly what it left
(staging directories, rank files, temporary files) and nothing else. ``FSDP_OPTIM_WRITER_TRIALS`` runs
the randomized two-job save race more often (default 1; the long campaign is marked ``slow``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import _attacks as A
import _models as M
import pytest
import torch
from _dist import run_ranks

from fsdp_optim import consolidate, save_sharded_optim_state
from fsdp_optim.core.checksums import digest
from fsdp_optim.disk.locks import LOCK_SUFFIX
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME

TRIALS = int(os.environ.get("FSDP_OPTIM_WRITER_TRIALS", "1"))
FLOCK: dict[str, str] = {}
EXCLUSIVE = {"FSDP_OPTIM_LOCK": "exclusive"}
LOCK_MODES = [pytest.param(FLOCK, id="flock"), pytest.param(EXCLUSIVE, id="exclusive-file")]


def _job(rank: int, world_size: int, out_dir: str) -> None:
    out = Path(out_dir)
    for name, seed in (("a", 0), ("b", 1)):
        model = M.wrap(M.make_net(seed), "deep")
        optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(model))
        for step in range(2 + seed):
            M.train_step(model, optim, *M.local_batch(step, rank, world_size))
        save_sharded_optim_state(model, optim, out / name)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two checkpoints of different states (``a``, ``b``), saved by a world-size-2 job."""
    out = tmp_path_factory.mktemp("writers")
    run_ranks(_job, 2, str(out))
    return out


def _clean(directory: Path) -> None:
    """``directory`` holds exactly a checkpoint (manifest and its files), and nothing of ours is left
    beside it (no staging directory, no lock file)."""
    files = {f.file for f in read_manifest(directory).files}
    assert set(os.listdir(directory)) == files | {MANIFEST_NAME}, sorted(os.listdir(directory))
    leftovers = [n for n in os.listdir(directory.parent) if n.startswith(f".{directory.name}.")]
    assert not leftovers, f"left beside {directory}: {leftovers}"


def _state(directory: Path) -> str:
    full = consolidate(directory)  # every checksum verified
    return digest({**full, "fsdp_optim": {**full["fsdp_optim"], "world_size": None}})


# --- two reshards into one directory ------------------------------------------------------------------


@pytest.mark.parametrize("env", LOCK_MODES)
def test_a_second_reshard_into_a_directory_being_written_is_refused_naming_the_holder(
    sources: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    out, started, hold = tmp_path / "out", tmp_path / "started", tmp_path / "hold"
    first = A.launch(A.slow_reshard, str(sources / "a"), 3, str(out), 0.2, str(started), env, str(hold))
    A.wait_for(started)  # the first writer holds the lock and waits, writing, until the second one is done
    second = A.bounded(A.slow_reshard, str(sources / "b"), 2, str(out), 0.0, str(tmp_path / "s2"), env)
    hold.touch()
    assert second.kind == "raised" and "OutputLockedError" in second.bases, second
    assert "another writer is writing there" in second.message and f"pid {first.process.pid}" in second.message
    assert "reshard" in second.message, second.message
    done = A.collect(first)
    assert done.kind == "ok", done
    assert _state(out) == _state(sources / "a")
    _clean(out)


@pytest.mark.parametrize("env", LOCK_MODES)
def test_two_reshards_racing_leave_the_checkpoint_of_one_that_succeeded(
    sources: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    out = tmp_path / "out"
    runs = {
        name: A.launch(A.slow_reshard, str(sources / name), 3, str(out), 0.01, str(tmp_path / name), env)
        for name in ("a", "b")
    }
    outcomes = {name: A.collect(run) for name, run in runs.items()}
    succeeded = [name for name, o in outcomes.items() if o.kind == "ok"]
    for name, o in outcomes.items():  # each succeeded, or was refused because the other held the lock
        assert o.kind == "ok" or (o.kind == "raised" and "OutputLockedError" in o.bases), f"{name}: {o}"
    assert succeeded, outcomes
    assert _state(out) in {_state(sources / name) for name in succeeded}
    _clean(out)


# --- killed writers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("env", LOCK_MODES)
def test_a_killed_reshard_keeps_the_previous_checkpoint_and_the_next_one_cleans_up(
    sources: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    out, started = tmp_path / "out", tmp_path / "started"
    assert A.bounded(A.reshard_entry, str(sources / "a"), 2, str(out)).kind == "ok"
    previous = _state(out)
    never = str(tmp_path / "never")  # it waits, writing, after its first unit until it is killed
    writer = A.launch(A.slow_reshard, str(sources / "b"), 3, str(out), 0.5, str(started), env, never)
    A.wait_for(started)
    os.kill(writer.process.pid, signal.SIGKILL)
    assert A.collect(writer).kind == "died"
    staging = [n for n in os.listdir(tmp_path) if ".fsdp-optim-staging." in n]
    assert staging and (tmp_path / f".out{LOCK_SUFFIX}").exists(), os.listdir(tmp_path)  # what it left
    assert _state(out) == previous, "the killed writer changed the checkpoint"
    # The next writer (another process) recovers: it removes the staging, and only that.
    (tmp_path / "notes.txt").write_text("beside the output, not ours")
    again = A.bounded(A.slow_reshard, str(sources / "b"), 4, str(out), 0.0, str(tmp_path / "s2"), env)
    assert again.kind == "ok", again
    assert _state(out) == _state(sources / "b")
    _clean(out)
    assert (tmp_path / "notes.txt").read_text() == "beside the output, not ours"


def test_a_lock_whose_holder_died_is_taken_over_in_exclusive_file_mode(sources: Path, tmp_path: Path) -> None:
    out, held = tmp_path / "out", tmp_path / "held"
    holder = A.launch(A.hold_lock, str(out), "a writer that will be killed", str(held), EXCLUSIVE)
    A.wait_for(held)
    os.kill(holder.process.pid, signal.SIGKILL)
    A.collect(holder)
    lock = tmp_path / f".out{LOCK_SUFFIX}"
    assert lock.exists(), "the O_EXCL lock file outlives its killed holder"
    taken = A.bounded(A.slow_reshard, str(sources / "b"), 2, str(out), 0.0, str(tmp_path / "s"), EXCLUSIVE)
    assert taken.kind == "ok", taken
    assert not lock.exists() and _state(out) == _state(sources / "b")


def test_a_live_lock_holder_is_never_overridden(sources: Path, tmp_path: Path) -> None:
    for env in (FLOCK, EXCLUSIVE):
        out, held = tmp_path / f"out-{bool(env)}", tmp_path / f"held-{bool(env)}"
        holder = A.launch(A.hold_lock, str(out), "a live writer", str(held), env)
        A.wait_for(held)
        try:
            refused = A.bounded(A.slow_reshard, str(sources / "a"), 2, str(out), 0.0, str(tmp_path / "x"), env)
            assert refused.kind == "raised" and "OutputLockedError" in refused.bases, refused
            assert "a live writer" in refused.message and f"pid {holder.process.pid}" in refused.message
            assert not out.exists()
        finally:
            os.kill(holder.process.pid, signal.SIGKILL)
            A.collect(holder)


# --- two saving jobs into one directory -------------------------------------------------------------------


def _race(tmp_path: Path, seed: int, env: dict[str, str], kill: bool) -> None:
    """Two world-size-1 FSDP jobs save into one directory at random moments; one may be SIGKILLed."""
    rng = random.Random(seed)
    directory, reports = tmp_path / "ckpt", [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    runs = [A.launch(A.save_job, str(directory), s, 4, str(reports[s]), env) for s in (0, 1)]
    if kill:
        victim = rng.randrange(2)
        A.wait_for(reports[victim], timeout_s=120)  # it saved at least once
        try:
            os.kill(runs[victim].process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it finished its saves before the signal: a race without a kill
            pass
    outcomes = [A.collect(run, timeout_s=240) for run in runs]
    lines: list[dict[str, Any]] = [json.loads(line) for r in reports if r.exists() for line in r.read_text().splitlines()]
    for o in outcomes:
        assert o.kind == "ok" or (kill and o.kind == "died"), f"seed {seed}: {o}"
    failures = [line for line in lines if not line["ok"]]
    assert all(line["error"] == "OutputLockedError" for line in failures), f"seed {seed}: {failures}"
    successes = sorted((line for line in lines if line["ok"]), key=lambda line: line["t"])
    assert successes, f"seed {seed}: no save succeeded: {lines}"
    on_disk = digest(consolidate(directory))
    assert on_disk in {line["digest"] for line in successes}, f"seed {seed}: the directory holds no reported save"
    if not kill:
        # The lock serializes the commits: the last save to report success is the one on disk, unless
        # the other job committed in the instant between that save's release of the lock and its report.
        assert on_disk in {line["digest"] for line in successes[-2:]}, f"seed {seed}"
    # The next save (a fresh job, as after a restart) succeeds and leaves only its own checkpoint.
    after = A.bounded(A.save_job, str(directory), 2, 1, str(tmp_path / "c.jsonl"), env, timeout_s=240)
    assert after.kind == "ok", after
    last = json.loads((tmp_path / "c.jsonl").read_text().splitlines()[-1])
    assert last["ok"] and digest(consolidate(directory)) == last["digest"], last
    _clean(directory)


@pytest.mark.parametrize("kill", [False, True], ids=["both finish", "one is SIGKILLed"])
def test_two_jobs_saving_into_one_directory(tmp_path: Path, kill: bool) -> None:
    for trial in range(TRIALS):
        where = tmp_path / f"trial{trial}"
        where.mkdir()
        _race(where, 1000 * trial + kill, FLOCK, kill)


@pytest.mark.slow
@pytest.mark.parametrize("env", LOCK_MODES)
def test_two_jobs_saving_into_one_directory_campaign(tmp_path: Path, env: dict[str, str]) -> None:
    for trial in range(max(TRIALS, 6)):
        where = tmp_path / f"trial{trial}"
        where.mkdir()
        _race(where, 7 + trial, env, kill=trial % 2 == 1)


def test_a_save_into_a_directory_holding_foreign_files_is_refused_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "weights.safetensors").write_bytes(b"not ours")
    results = run_ranks(_save_into, 2, str(directory))
    for rank, (error, message, names) in enumerate(results):
        assert error in ("ForeignOutputError", "OSError"), f"rank {rank}: {error}: {message}"
        assert "weights.safetensors" in message and "overwrite=True" in message, message
        assert names == ["weights.safetensors"], f"rank {rank} saw {names}: something was written"
    shutil.rmtree(directory)


def test_a_save_with_overwrite_over_a_foreign_manifest_json_is_refused_and_keeps_it(tmp_path: Path) -> None:
    """``overwrite=True`` writes beside foreign files, but our commit would rename over another tool's
    ``manifest.json``: refused on every rank, the file kept byte for byte."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    foreign = b'{"model": "someone else\'s"}'
    (directory / "manifest.json").write_bytes(foreign)
    results = run_ranks(_save_into, 2, str(directory), True)
    for rank, (error, message, names) in enumerate(results):
        assert error in ("ForeignOutputError", "OSError"), f"rank {rank}: {error}: {message}"
        assert "manifest.json is not an fsdp_optim manifest" in message and "even with overwrite" in message, message
        assert names == ["manifest.json"], f"rank {rank} saw {names}: something was written"
    assert (directory / "manifest.json").read_bytes() == foreign, "the foreign manifest.json changed"
    shutil.rmtree(directory)


def _save_into(rank: int, world_size: int, directory: str, overwrite: bool = False) -> tuple[str, str, list[str]]:
    model = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(model))
    M.train_step(model, optim, *M.local_batch(0, rank, world_size))
    before = {k: v.clone() for k, v in optim.state_dict()["state"].get(0, {}).items() if torch.is_tensor(v)}
    try:
        save_sharded_optim_state(model, optim, directory, overwrite=overwrite)
        raise AssertionError("the save was not refused")
    except OSError as exc:
        outcome = (type(exc).__name__, str(exc))
    after = optim.state_dict()["state"].get(0, {})
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the optimizer changed"
    import torch.distributed as dist

    dist.barrier()
    return (*outcome, sorted(os.listdir(directory)))
