"""Callers hold one :class:`~fsdp_optim.disk.location.Location` and never ask which backend it is.

- A load resolves its path once: the backend registered for a URL's scheme is opened once per load, however many
  readers (the job's entry, the checkpoint's directory, its manifest, its side files) then use it. Counted by a
  real backend (``tests/_flat_store.py``) in a real job, not by patching the package.
- Outside ``fsdp_optim/disk/``, at most three ``local_path()`` calls remain, each a capability said so beside it,
  and no ``isinstance`` names a backend's class.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import _models as M
from _checks import assert_identical
from _dist import run_ranks
from _flat_store import FlatStore

import fsdp_optim

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_optim"
BACKEND_TYPES = ("Location", "LocalDirectory", "ObjectStore", "ObjectPath", "NodeMemory", "Path")
OPENED: list[str] = []  # the URLs the counting backend was opened for, in this rank's process


def _counted(url: str, options: dict[str, Any]) -> FlatStore:  # noqa: ARG001 - the opener's signature
    OPENED.append(url)
    root, _, prefix = url.removeprefix("count://").partition("/ckpt-")
    return FlatStore(root, f"ckpt-{prefix}")


def _opens_per_load(rank: int, world_size: int, url: str) -> dict[str, int]:
    fsdp_optim.register_backend("count", _counted)
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, url, extra={"step": 1})
    fsdp_optim.save_sharded_optim_state(root, optim, url + "-optim")
    opens = {}
    fresh = M.wrap(M.make_net(seed=7), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    OPENED.clear()
    fsdp_optim.load_checkpoint(fresh, fresh_optim, url)
    opens["load_checkpoint"] = len(OPENED)
    assert_identical(fresh_optim.state_dict(), optim.state_dict(), f"rank {rank}: the optimizer loaded")
    other = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    OPENED.clear()
    fsdp_optim.load_sharded_optim_state(fresh, other, url + "-optim")
    opens["load_sharded_optim_state"] = len(OPENED)
    assert_identical(other.state_dict()["state"], optim.state_dict()["state"], f"rank {rank}: the state loaded")
    return opens


def test_a_load_resolves_its_path_once(tmp_path: Path) -> None:
    outs = run_ranks(_opens_per_load, 2, f"count://{tmp_path / 'objects'}/ckpt-run")
    for rank, opens in enumerate(outs):
        assert opens == {"load_checkpoint": 1, "load_sharded_optim_state": 1}, f"rank {rank}: backend opened {opens}"


def _package_lines() -> list[tuple[str, int, str, list[str]]]:
    """``(module, line number, line, the lines before it)`` of every module outside ``disk/``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("disk/"):
            continue
        lines = path.read_text().splitlines()
        found += [(module, i + 1, line, lines[max(i - 6, 0) : i]) for i, line in enumerate(lines)]
    return found


def test_no_backend_question_outside_disk() -> None:
    lines = _package_lines()
    calls = [(m, n, before) for m, n, line, before in lines if "local_path()" in line]
    assert len(calls) <= 3, f"local_path() outside disk/: {[(m, n) for m, n, _ in calls]}"
    unexplained = [(m, n) for m, n, before in calls if not any("capability" in b.lower() for b in before)]
    assert not unexplained, f"local_path() without the capability it stands for said beside it: {unexplained}"
    backend = re.compile(r"isinstance\([^)]*\b(" + "|".join(BACKEND_TYPES) + r")\b")
    asked = [(m, n, line.strip()) for m, n, line, _ in lines if backend.search(line)]
    assert not asked, f"isinstance on a backend's (or a path's) type outside disk/: {asked}"
