"""The requests a whole save makes of an fsspec store, counted by the filesystem itself: a real fsspec local
filesystem (a subclass that counts its own calls, nothing replaced), under a real job (a process group, FSDP, a
training step). Each request is a round trip on a real store, so a save asks nothing it already knows.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import _models as M
from _dist import run_ranks
from fsspec.implementations.local import LocalFileSystem

import fsdp_optim
from fsdp_optim.disk.storage import ObjectStore

REQUESTS = ("ls", "info", "cat_file", "cat_ranges", "put_file", "pipe_file", "rm_file", "exists", "find", "open")


class CountingFileSystem(LocalFileSystem):
    """fsspec's local filesystem, counting the calls made of it from outside (its own inner calls not counted)."""

    cachable = False  # a fresh instance, with its own counts, per test

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: collections.Counter[str] = collections.Counter()
        self._depth = 0


def _counted(name: str) -> Any:
    def call(self: CountingFileSystem, *args: Any, **kwargs: Any) -> Any:
        if self._depth == 0:
            self.counts[name] += 1
        self._depth += 1
        try:
            return getattr(LocalFileSystem, name)(self, *args, **kwargs)
        finally:
            self._depth -= 1

    return call


for _name in REQUESTS:
    setattr(CountingFileSystem, _name, _counted(_name))


def _save_twice(rank: int, world_size: int, tmp: str) -> dict[str, int]:
    """Save a whole checkpoint into a counted store, train a step, save again over it; the second save's requests."""
    fs = CountingFileSystem(auto_mkdir=True)
    store = ObjectStore(f"counted://{tmp}/ckpt", fs, f"{tmp}/ckpt")
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, store, extra={"step": 1})
    M.train_step(root, optim, *M.local_batch(1, rank, world_size))
    fs.counts.clear()
    fsdp_optim.save_checkpoint(root, optim, store, extra={"step": 2})
    counts = dict(fs.counts)
    assert fsdp_optim.verify(store).ok, "the second save is a valid checkpoint"
    return counts


def test_a_save_over_a_checkpoint_asks_the_store_nothing_its_listing_told_it(tmp_path: Path) -> None:
    """Rank 0 lists the prefix once at the start; the manifest there is then read once (its size and version are
    the listing's, not asked again); the commit's check asks the manifest's version once (fsspec's local filesystem
    has no conditional put); the files the commit replaced are found by one more listing and removed."""
    (counts,) = run_ranks(_save_twice, 1, str(tmp_path))
    assert counts.get("ls") == 2, f"one listing to begin, one to tidy: {counts}"
    assert counts.get("info") == 1, f"one version check at the commit, no size or etag asked after listing: {counts}"
    assert counts.get("cat_file") == 1, f"the committed manifest read once: {counts}"
    assert counts.get("pipe_file") == 1 and counts.get("put_file") == 2, f"the manifest, the two rank files: {counts}"
    assert not {"exists", "find", "open"} & set(counts), f"no other request: {counts}"
