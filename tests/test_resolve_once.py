"""A path is resolved to its :class:`~fsdp_optim.disk.location.Location` once, at the public entry point, and the
location is passed down: a one-process ``load_checkpoint`` of a real checkpoint calls ``where()`` once.

Counted with a profile hook on ``where``'s own code (every call, whatever name a module imported it under), around
a real load on a real one-rank gloo group."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import _models as M
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.disk.locations import where


def where_calls(run: Any) -> list[str]:
    """``run()``, and the caller (``file:line``) of each call of ``where`` it made."""
    callers: list[str] = []

    def hook(frame: FrameType, event: str, _: Any) -> None:
        if event == "call" and frame.f_code is where.__code__ and frame.f_back is not None:
            callers.append(f"{frame.f_back.f_code.co_filename}:{frame.f_back.f_lineno}")

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return callers


def _save_then_load(rank: int, world_size: int, out: str) -> list[str]:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, out, extra={"step": 1})
    loaded: list[Any] = []
    callers = where_calls(lambda: loaded.append(fsdp_optim.load_checkpoint(root, optim, out)))
    assert loaded == [{"step": 1}], f"the load returned {loaded}, expected the saved extra"
    return callers


def test_load_checkpoint_resolves_its_path_once(tmp_path: Path) -> None:
    callers = run_ranks(_save_then_load, 1, str(tmp_path / "ckpt"))[0]
    assert len(callers) == 1, f"where() called {len(callers)} times in one load_checkpoint, expected 1: {callers}"
