"""CheckpointManager in a real 2-rank training loop, on real files.

One run trains steps 1..12 saving every 2 steps (keep 2, keep_every 4) and is killed with a real ``SIGKILL`` in the
middle of its save of step 12, on every rank, after each rank's files are durable and before rank 0's manifest: a
torn step. The test then flips one byte of a rank file of step 10 (damaged). ``latest()`` skips both, naming each,
and returns 8; ``fsdp-optim list`` shows them; a second run restores step 8 and trains on to step 14, and its
optimizer state matches uninterrupted training without FSDP. Foreign files in the root, and step directories that
hold one, are never deleted.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import _models as M
import pytest
from _checks import assert_full_matches_plain
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.core.steps import parse_step_dir, step_dir_name, steps_to_keep

EVERY, KEEP, KEEP_EVERY = 2, 2, 4
KILL_AT, FINAL = 12, 14
REL = 1e-4


def _kill_before_commit() -> None:
    """The next save dies on every rank once its own rank and side files are written: commit_save's gather of the
    ranks' reports (before rank 0 writes the manifest) becomes a SIGKILL of the calling process."""
    import fsdp_optim.job.save_commit as save_commit  # the save protocol's home since it left job/sharded.py

    def die(*_: Any, **__: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    save_commit.gather_objects = die  # type: ignore[assignment]


def _loop(rank: int, world_size: int, root: str, seed: int, stop: int, kill_at: int | None) -> dict[str, Any]:
    manager = fsdp_optim.CheckpointManager(root, every=EVERY, keep=KEEP, keep_every=KEEP_EVERY)
    model = M.wrap(M.make_net(seed), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = manager.restore(model, optim)
        start = extra["step"] if extra is not None else 0
        assert extra is None or extra["rank"] == rank, f"rank {rank} got the extra of rank {extra['rank']}"
        skipped = [(s.step, s.state, s.reason) for s in manager.skipped]
        for step in range(start + 1, stop + 1):
            M.train_step(model, optim, *M.local_batch(step - 1, rank, world_size))
            if step == kill_at:
                _kill_before_commit()
            saved = manager.save(step, model, optim, extra={"step": step, "rank": rank})
            assert (saved is not None) == (step % EVERY == 0), f"step {step}: save returned {saved}"
            if step == 2 and rank == 0:  # a file of the user's inside a complete step directory
                (Path(root) / step_dir_name(2) / "notes.txt").write_text("mine")
    full = model.gather_full_optim_state_dict(optim)
    return {"start": start, "skipped": skipped, "warnings": [str(w.message) for w in caught], "optim": full}


def _steps(root: Path) -> list[int]:
    return sorted(s for s in map(parse_step_dir, os.listdir(root)) if s is not None)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _list(root: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["list", str(root), *flags]) == 0, "fsdp-optim list exits 0 whatever it finds"
    return capsys.readouterr().out


def test_loop_prunes_resumes_past_torn_and_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    (root / "runs").mkdir(parents=True)
    (root / "runs" / "events.txt").write_text("a foreign directory")
    (root / "notes.txt").write_text("a foreign file")
    (root / step_dir_name(1)).mkdir()
    (root / step_dir_name(1) / "mine.txt").write_text("a step directory holding a foreign file")

    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_loop, 2, str(root), 0, FINAL, KILL_AT)
    # saved 2, 4, 6, 8, 10; the prune after 10 kept the newest two (8, 10) and 4 (keep_every), removed 6; 1 and 2
    # hold foreign files; 12 was killed before its commit.
    assert _steps(root) == [1, 2, 4, 8, 10, 12]
    assert (root / "notes.txt").exists() and (root / "runs" / "events.txt").exists()
    torn = sorted(os.listdir(root / step_dir_name(12)))
    assert "manifest.json" not in torn and any(n.startswith("optim-") for n in torn), torn
    victim = sorted((root / step_dir_name(10)).glob("optim-*-rank00001-of-00002.safetensors"))[0]
    _flip_last_byte(victim)

    manager = fsdp_optim.CheckpointManager(root, every=EVERY, keep=KEEP)
    with pytest.warns(UserWarning, match="skipped step 12"):
        assert manager.latest() == 8
    assert [(s.step, s.state) for s in manager.skipped] == [(12, "torn"), (10, "damaged")]
    assert "no manifest" in manager.skipped[0].reason
    assert victim.name in manager.skipped[1].reason, manager.skipped[1].reason

    listed = _list(root, capsys).splitlines()
    states = {int(line.split()[1]): line.split()[2].rstrip(":") for line in listed}
    assert states == {1: "torn", 2: "complete", 4: "complete", 8: "complete", 10: "damaged", 12: "torn"}, listed
    assert "world size 2" in listed[2] and "model + optimizer (Adam)" in listed[2], listed[2]
    assert victim.name in listed[4] and "not ours: mine.txt" in listed[0], listed
    records = json.loads(_list(root, capsys, "--json"))["steps"]
    assert [(r["step"], r["state"]) for r in records] == sorted(states.items())
    assert all(r["bytes"] > 0 for r in records)

    results = run_ranks(_loop, 2, str(root), 123, FINAL, None)  # another init: the restore must win
    for result in results:
        assert result["start"] == 8
        assert [(s, state) for s, state, _ in result["skipped"]] == [(12, "torn"), (10, "damaged")]
    said = "\n".join(results[0]["warnings"])
    assert "skipped step 12" in said and "skipped step 10" in said, said
    assert f"kept {root / step_dir_name(2)}" in said and "notes.txt" in said, said
    assert f"kept {root / step_dir_name(1)}" in said and "mine.txt" in said, said
    assert not any("skipped" in w for w in results[1]["warnings"]), "rank 0 alone warns of what it verified"
    # 10 and 12 were saved again over the damaged and the torn one; after 14: 12, 14 (newest) and 4, 8, 12.
    assert _steps(root) == [1, 2, 4, 8, 12, 14]
    assert fsdp_optim.CheckpointManager(root, every=EVERY, keep=KEEP).latest() == 14
    assert (root / "notes.txt").exists() and (root / "runs" / "events.txt").exists()
    assert not list(root.glob(".step-*.fsdp-optim.lock")), sorted(os.listdir(root))

    _, plain = M.train_plain("adam", range(FINAL), net=M.make_net(0))
    skip_unused = lambda name: name.startswith("unused.")  # noqa: E731 - never used: a plain Adam has no state
    assert_full_matches_plain(results[0]["optim"], plain.state_dict(), skip=skip_unused, rel=REL)

    side = sorted((root / step_dir_name(4)).glob("train-*-rank00000-of-00002.safetensors"))[0]
    _flip_last_byte(side)  # verify reads a whole checkpoint's side files too
    report = fsdp_optim.verify(root / step_dir_name(4))
    assert not report.ok and side.name in "\n".join(report.damaged()), report.lines()


def test_steps_to_keep_and_names() -> None:
    assert sorted(steps_to_keep([2, 4, 6, 8, 10], keep=2, keep_every=4)) == [4, 8, 10]
    assert sorted(steps_to_keep([3, 1, 2], keep=5, keep_every=None)) == [1, 2, 3]
    assert step_dir_name(42) == "step-00000042" and parse_step_dir("step-00000042") == 42
    assert parse_step_dir("step-42") is None and parse_step_dir("step-000000042") is None
    with pytest.raises(ValueError, match="step: expected an int"):
        step_dir_name(10**8)


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep: expected a positive int, found 0"):
        fsdp_optim.CheckpointManager(tmp_path, every=1, keep=0)
    fresh = fsdp_optim.CheckpointManager(tmp_path / "none", every=1, keep=1)
    assert fresh.latest() is None and fresh.skipped == ()
