"""A reshard written to an object store uploads each rank file as soon as it is written, while the next ones are cut
(fsdp_optim/offline/publish.py: ``checkpoint_output``), against the real S3 server of tests/_s3.py; a reshard that
fails part way leaves nothing in the store, not even the files it had uploaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _models as M
import pytest
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.formats.sharded.locate import read_manifest


def _save(rank: int, world_size: int, local: str) -> None:
    root = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, local, extra={"rank": rank})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    local = tmp_path_factory.mktemp("publish") / "ckpt"
    run_ranks(_save, 2, str(local))
    return local


def _rank_files(store: Any) -> list[str]:
    return sorted(n for n in store.listing() if n.startswith("optim-"))


def test_rank_files_are_uploaded_while_the_next_are_cut(s3_server: Any, saved: Path) -> None:
    url = s3_server.url("early")
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    units, calls, early = len(read_manifest(saved).flat_params), [], []

    def progress() -> None:  # a small model is re-cut by blocks: one call after each output rank's file is written
        calls.append(1)
        if len(calls) == 2:  # ranks 0 and 1 are written, their uploads under way; rank 2 is not cut yet
            early.extend(_wait_for(store, 2))

    fsdp_optim.reshard(str(saved), 3, store, progress=progress)
    assert len(calls) == 3, f"{len(calls)} calls for {units} units: one per output rank expected (by blocks)"
    assert len(early) == 2, f"rank files in the store while rank 2 was being cut: {early}"
    assert len(_rank_files(store)) == 3 and fsdp_optim.verify(store).ok


def _wait_for(store: Any, count: int, timeout_s: float = 30) -> list[str]:
    import time

    deadline = time.monotonic() + timeout_s
    while len(found := _rank_files(store)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_reshard_that_fails_part_way_leaves_nothing(s3_server: Any, saved: Path) -> None:
    store = fsdp_optim.open_store(s3_server.url("failed"), **s3_server.storage_options)
    calls: list[int] = []

    def progress() -> None:
        calls.append(1)
        if len(calls) == 2:
            _wait_for(store, 1)  # an upload landed
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fsdp_optim.reshard(str(saved), 3, store, progress=progress)
    assert store.listing() == {}, "the uploads of a reshard that failed are removed"


def test_the_command_line_reshard_uploads_each_rank_file_once_written(
    s3_server: Any, saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_optim.cli import main as cli_main
    from fsdp_optim.offline.publish import Uploads

    started, real = [], Uploads.file_done

    def file_done(self: Uploads, path: Path) -> None:  # the real call, seen
        started.append(path.name)
        real(self, path)

    monkeypatch.setattr(Uploads, "file_done", file_done)
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    url = s3_server.url("cli")
    assert cli_main(["reshard", str(saved), "--world-size", "3", "-o", url]) == 0
    store = fsdp_optim.open_store(url, **s3_server.storage_options)
    assert sorted(started) == _rank_files(store) and len(started) == 3, started
    assert fsdp_optim.verify(store).ok
