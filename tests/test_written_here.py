"""One way to write an output anywhere: :meth:`~fsdp_optim.disk.location.Location.written_here`.

A local output is written in place (its path as the caller gave it); a store's is written to a local copy, published
when the block ends cleanly, and the copy removed however it ends. ``to_safetensors``, ``to_dcp``, ``reshard`` and
the command line all go through it (:func:`fsdp_optim.offline.publish.checkpoint_output`)."""

from __future__ import annotations

import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_optim
from fsdp_optim.disk.byte_io import read_all
from fsdp_optim.disk.locations import where
from fsdp_optim.offline.publish import checkpoint_output


def _full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(s, generator=g), "exp_avg_sq": torch.rand(s, generator=g)}
             for i, s in {0: (6, 5), 1: (4,)}.items()}  # fmt: skip
    return {
        "state": state,
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0, 1]}],
        "param_names": {0: "w", 1: "b"},
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 1, "scalar_keys": ["step"]},
    }


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the local copies go, to see them removed."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def test_a_local_output_is_written_in_place_as_given(tmp_path: Path) -> None:
    given = str(tmp_path / "out") + "/"

    @contextmanager
    def never(local: Path) -> Any:
        raise AssertionError(f"a local output is not published ({local})")
        yield

    with where(given).written_here(never) as (local, published):
        assert local == given and published is None, f"in place, as given: {local!r}, {published!r}"


def test_a_store_output_is_published_from_a_local_copy_then_removed(tmp_path: Path, scratch: Path) -> None:
    url = f"memory://written-here/{uuid.uuid4().hex[:8]}"
    fsdp_optim.to_safetensors(_full(), tmp_path / "optim.safetensors")
    fsdp_optim.to_safetensors(_full(), f"{url}/optim.safetensors")
    store = where(url)
    assert bytes(read_all(store, "optim.safetensors", limit=1 << 20)) == (tmp_path / "optim.safetensors").read_bytes()
    fsdp_optim.to_dcp(_full(), f"{url}/dcp")
    assert ".metadata" in store.child("dcp").listing(), f"a DCP directory, uploaded: {store.child('dcp').listing()}"
    assert list(scratch.iterdir()) == [], f"the local copies are removed: {list(scratch.iterdir())}"


def test_a_failed_block_publishes_nothing_and_removes_the_copy(scratch: Path) -> None:
    url = f"memory://written-here/{uuid.uuid4().hex[:8]}/out"
    with pytest.raises(RuntimeError, match="the writer failed"), checkpoint_output(url) as (local, file_done):
        assert file_done is not None, "a store's rank files can be uploaded as they are done"
        Path(local).mkdir()
        (Path(local) / "file.bin").write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert where(url).listing() == {} and list(scratch.iterdir()) == [], "nothing published, the copy removed"


def _layout_twice(rank: int, world_size: int, tmp: str) -> dict[str, Any]:  # noqa: ARG001 - run_ranks' signature
    import _models as M

    root = M.wrap(M.make_net(), "deep")
    url = f"memory://written-here/{uuid.uuid4().hex[:8]}"
    local = fsdp_optim.save_layout(root, Path(tmp) / "layout.json")
    stored = fsdp_optim.save_layout(root, f"{url}/layout.json")
    return {"local": str(local), "stored": str(stored), "same": bytes(read_all(where(url), "layout.json", limit=1 << 20))
            == (Path(tmp) / "layout.json").read_bytes()}  # fmt: skip


def test_save_layout_writes_a_local_file_in_place_and_a_store_object_whole(tmp_path: Path) -> None:
    from _dist import run_ranks

    (result,) = run_ranks(_layout_twice, 1, str(tmp_path))
    assert result["local"] == str(tmp_path / "layout.json"), f"the local file's path: {result}"
    assert result["stored"].startswith("memory://") and result["stored"].endswith("/layout.json"), f"{result}"
    assert result["same"], "the stored layout is the same bytes as the local one"
