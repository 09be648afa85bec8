"""Every :class:`~fsdp_optim.disk.location.Location` backend behaves alike behind the one interface.

The backends are the fixture's parameters: a local directory (``LocalDirectory``), an fsspec filesystem through
``ObjectStore`` (``memory://``: a backend the package has no code for, reached through the same class as S3), a
backend written here as one class with its own commit rule (``tests/_flat_store.py``), the same backend registered
for its URL scheme and reached through ``where("flat://...")`` as a user's own backend is, and a step of the memory tier
(``NodeMemory``: a node's directory, committed by a collective seal, its missing bytes received from peers). A new
backend is one more parameter here. The same calls (listing, sizes, ranged reads, the save call order through a
real job, a second save replacing the first, a refusal of foreign content; a manager's save, prune and restore)
give the same results on each.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import _models as M
import pytest
from _checks import assert_identical
from _dist import run_ranks
from _flat_store import FlatStore, open_flat

import fsdp_optim
from fsdp_optim import ForeignOutputError
from fsdp_optim.disk.byte_io import read_all
from fsdp_optim.disk.local_directory import LocalDirectory
from fsdp_optim.disk.location import Location, as_local_file, identity, non_objects, present
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.memory_tier import node_dir, read_holdings
from fsdp_optim.job.node_memory import NodeMemory

BACKENDS = ["local", "memory", "flat", "url", "node"]
# "url": the same flat backend registered for its scheme, as a user adds one, and reached through where("flat://...")
# (at this module's import: a spawned rank imports it too, and registers it again)
fsdp_optim.register_backend("flat", open_flat)
# A memory-tier step is written once, by the save whose id names its directory: a second save is a new step, never a
# replacement, so the memory tier's job runs through a checkpoint manager (save, prune, restore) only.
REPLACING = [kind for kind in BACKENDS if kind != "node"]


def _location(kind: str, tmp: str) -> Location:
    """A fresh, empty location of backend ``kind`` (in this process: ``memory://`` lives in the process)."""
    if kind == "local":
        return LocalDirectory(Path(tmp) / f"ckpt-{uuid.uuid4().hex[:8]}")
    if kind == "flat":
        return FlatStore(Path(tmp) / "flat", f"ckpt-{uuid.uuid4().hex[:8]}")
    if kind == "url":
        return where(f"flat://{Path(tmp) / 'flat'}/ckpt-{uuid.uuid4().hex[:8]}")
    if kind == "node":  # (its group, the default one, is used only by a save's seal and a load's prefetch)
        return NodeMemory(Path(tmp) / "tier" / "node-0" / f"step-{uuid.uuid4().hex[:8]}", None)
    return fsdp_optim.open_store(f"memory://location-test/ckpt-{uuid.uuid4().hex[:8]}")


def _save_twice_and_load(rank: int, world_size: int, kind: str, tmp: str) -> dict[str, Any]:
    """Save a whole checkpoint, train a step, save again into the same location (replacing the first), load it into
    a fresh model; what the location holds after each save, and what the load gave against the live state."""
    location = _location(kind, tmp)
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    first = fsdp_optim.save_checkpoint(root, optim, location, extra={"step": 1})
    after_first = sorted(location.listing())
    M.train_step(root, optim, *M.local_batch(1, rank, world_size))
    second = fsdp_optim.save_checkpoint(root, optim, location, extra={"step": 2})
    after_second = sorted(location.listing())
    fresh = M.wrap(M.make_net(seed=7), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    extra = fsdp_optim.load_checkpoint(fresh, fresh_optim, location)
    assert_identical(fresh.state_dict(), root.state_dict(), f"{kind}: weights")
    assert_identical(fresh_optim.state_dict(), optim.state_dict(), f"{kind}: optimizer")
    return {"first": str(first), "second": str(second), "after_first": after_first, "after_second": after_second,
            "extra": extra, "where": str(location), "verified": fsdp_optim.verify(location).ok}  # fmt: skip


@pytest.mark.parametrize("kind", REPLACING)
def test_a_job_saves_replaces_and_loads_through_each_backend(kind: str, tmp_path: Path) -> None:
    (out,) = run_ranks(_save_twice_and_load, 1, kind, str(tmp_path))
    assert out["first"] == out["second"] == f"{out['where']}/manifest.json", out
    assert len(out["after_first"]) == len(out["after_second"]) == 3, out  # manifest, rank file, side file
    assert set(out["after_first"]) & set(out["after_second"]) == {"manifest.json"}, "the first save's files stay"
    assert out["extra"] == {"step": 2} and out["verified"], out


@pytest.mark.parametrize("kind", BACKENDS)
def test_reads_are_the_same_on_each_backend(kind: str, tmp_path: Path) -> None:
    location = _location(kind, str(tmp_path))
    assert location.listing() == {} and location.prefixes() == [] and location.size("x") is None
    data = bytes(range(256)) * 5
    _publish(location, "blob", data)
    assert location.size("blob") == len(data) and sorted(location.listing()) == ["blob"]
    assert bytes(location.read_range("blob", 10, 300)) == data[10:300]
    parts = [bytearray(7), bytearray(100), bytearray(3)]
    location.read_into("blob", 500, [memoryview(p) for p in parts])
    assert b"".join(parts) == data[500:610]
    assert read_all(location, "blob", limit=len(data)) == data
    with pytest.raises(ValueError, match="above the bound"):
        read_all(location, "blob", limit=10)
    with pytest.raises(FileNotFoundError):
        read_all(location, "missing", limit=10)
    assert str(location / "blob") == f"{location}/blob" and str(location.child("sub")) == f"{location}/sub"
    assert where(location) is location
    if kind != "flat":  # (a flat store built by hand is named by its object; registered, its URL leads to it)
        assert where(str(location)) == location


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_save_over_foreign_content_is_refused_alike(kind: str, tmp_path: Path) -> None:
    location = _location(kind, str(tmp_path))
    _publish(location, "notes.txt", b"mine")
    from fsdp_optim.formats.sharded.writer import save_rules

    with pytest.raises(ForeignOutputError, match="notes.txt"):
        location.writer(save_rules("1" * 32, 1)).begin(purpose="test", overwrite=False)
    assert sorted(location.listing()) == ["notes.txt"], "a refused save writes nothing"


def test_a_backend_is_eight_byte_methods_and_the_save_steps_are_written_once() -> None:
    """The interface is narrow (at most 10 abstract members; a user's backend in at most 80 lines); no backend
    carries the save protocol: its ``writer`` is one of three (a conditional put, a rename, the memory tier's, which
    overrides the commit alone), each at most 7 steps."""
    import _flat_store

    from fsdp_optim.disk.local_directory import RenameWriter
    from fsdp_optim.disk.save import Writer
    from fsdp_optim.disk.storage import ObjectStore
    from fsdp_optim.formats.sharded.writer import save_rules
    from fsdp_optim.job.node_memory import MemoryWriter

    assert len(Location.__abstractmethods__) <= 10, sorted(Location.__abstractmethods__)
    assert len(Path(_flat_store.__file__).read_text().splitlines()) <= 80, "the test backend is one small class"
    steps = {n for n in vars(Writer) if not n.startswith("__")}
    assert steps <= {"begin", "stage", "publish", "commit", "finish", "abort", "_remove"}, sorted(steps)
    assert {n for n in vars(MemoryWriter) if not n.startswith("_")} == {"commit"}, "the memory tier: its commit alone"
    kinds = {ObjectStore: Writer, FlatStore: Writer, LocalDirectory: RenameWriter, NodeMemory: MemoryWriter}
    for backend, kind in kinds.items():
        assert not {"publish", "stage", "commit_manifest", "finish_save"} & set(vars(backend)), backend.__name__
        assert backend.writer is not Location.writer or kind is Writer, backend.__name__
    assert type(LocalDirectory("x").writer(save_rules())) is RenameWriter, "a local directory renames"


def _publish(location: Location, name: str, data: bytes) -> None:
    """Object ``name`` written through the save protocol's staging and publish (no commit)."""
    from fsdp_optim.disk.save import Staging
    from fsdp_optim.formats.sharded.writer import save_rules

    writer = location.writer(save_rules("0" * 32, 1))
    staging = writer.stage("0" * 32, 0)
    staging.path.mkdir(parents=True, exist_ok=True)
    (staging.path / name).write_bytes(data)
    writer.publish(staging, [name])
    if staging.scratch:
        import shutil

        shutil.rmtree(staging.path)
    assert isinstance(staging, Staging), staging


def test_a_store_is_never_taken_for_a_local_path() -> None:
    store = fsdp_optim.open_store("memory://location-test/no-path")
    assert isinstance(store, Location) and not isinstance(store, os.PathLike)
    assert isinstance(LocalDirectory("x"), os.PathLike) and Path(LocalDirectory("x")) == Path("x")


@pytest.mark.parametrize("kind", BACKENDS)
def test_writes_removals_and_names_are_the_same_on_each_backend(kind: str, tmp_path: Path) -> None:
    location = _location(kind, str(tmp_path))
    location.child("sub").write("one", b"first")
    source = tmp_path / "source.bin"
    source.write_bytes(b"second object")
    location.child("sub").write("two", source)
    sub = location.child("sub")
    assert sorted(sub.listing()) == ["one", "two"] and location.prefixes() == ["sub"]
    assert bytes(sub.read_range("two", 0, 13)) == b"second object" and source.is_file(), "an upload copies"
    assert sub.parent() == location
    if kind != "flat":
        assert where(f"{location}/sub/one").parent() == sub
    sub.delete(["one", "missing"])
    assert sorted(sub.listing()) == ["two"]
    local = kind in ("local", "node")
    assert identity(location) == (str(Path(str(location)).absolute()) if local else str(location))


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_location_emptied_and_removed_is_gone_on_each_backend(kind: str, tmp_path: Path) -> None:
    location = _location(kind, str(tmp_path))
    sub = location.child("sub")
    sub.write("one", b"first")
    assert present(sub) and non_objects(sub) == [], f"{kind}: a location holding an object is present"
    with sub.removal(purpose="test removal") as remove_marker:
        assert remove_marker is not None, f"{kind}: no writer holds it, so it may be removed"
        sub.delete(sorted(sub.listing()))
        remove_marker()
    assert not present(sub) and "sub" not in location.prefixes(), f"{kind}: removed, not listed"


def test_a_local_directory_names_what_is_not_an_object_and_keeps_its_lock(tmp_path: Path) -> None:
    local = LocalDirectory(tmp_path / "step")
    (tmp_path / "step" / "inner").mkdir(parents=True)
    (tmp_path / "step" / "file").write_bytes(b"x")
    (tmp_path / "step" / "link").symlink_to(tmp_path / "step" / "file")
    assert sorted(local.listing()) == ["file"] and non_objects(local) == ["inner", "link"], "links, subdirectories"
    with local.removal(purpose="first") as held, local.removal(purpose="second") as again:
        assert held is not None and again is None, "a second remover finds the lock held and may remove nothing"


def test_only_a_local_directory_has_a_local_path(tmp_path: Path) -> None:
    assert where(tmp_path / "ckpt").local_path() == tmp_path / "ckpt"
    assert where(str(tmp_path / "ckpt" / "manifest.json")).local_path() == tmp_path / "ckpt" / "manifest.json"
    assert where("memory://location-test/remote").local_path() is None
    assert fsdp_optim.open_store("memory://location-test/remote").local_path() is None


@pytest.mark.parametrize("kind", BACKENDS)
def test_an_object_fetched_whole_is_the_same_on_each_backend(kind: str, tmp_path: Path) -> None:
    location = _location(kind, str(tmp_path))
    data = bytes(range(256)) * 9
    location.write("blob.pt", data)
    with as_local_file(location.child("blob.pt")) as local:
        assert isinstance(local, Path) and local.name == "blob.pt" and local.read_bytes() == data, kind
        copied = location.local_path() is None
    assert local.is_file() != copied, f"{kind}: its own file stays, a copy goes after the block"
    if kind == "local":
        assert local == location / "blob.pt", "a local directory yields its own file, copying nothing"
    into = tmp_path / "by-ranges.pt"
    Location.download(location, "blob.pt", into, size=len(data))  # the default: ranged reads, for any backend
    assert into.read_bytes() == data
    if not copied:  # a local file is itself, whatever is there: the reader that opens it says what is wrong
        with as_local_file(location.child("missing.pt")) as local:
            assert not Path(local).exists(), f"{kind}: nothing fetched, nothing made"
        return
    with pytest.raises(FileNotFoundError, match="missing.pt: no such object"):
        with as_local_file(location.child("missing.pt")):
            pass


def test_a_url_of_one_object_is_downloaded_whole_or_refused_by_name() -> None:
    from fsdp_optim.offline.sources import fetched_whole

    store = fsdp_optim.open_store(f"memory://location-test/one-{uuid.uuid4().hex[:8]}")
    store.write("full.pt", b"payload")
    with fetched_whole(f"{store}/full.pt") as local:
        assert local.read_bytes() == b"payload" and local.name == "full.pt"
    assert not local.exists(), "the download is removed after the block"
    with pytest.raises(FileNotFoundError, match=r"missing\.pt: no such object, and no manifest\.json under it"):
        with fetched_whole(f"{store}/missing.pt"):
            pass
    with pytest.raises(FileNotFoundError, match="^mine$"):  # the block's own errors pass as they are
        with fetched_whole(f"{store}/full.pt"):
            raise FileNotFoundError("mine")


def _managed(rank: int, world_size: int, kind: str, tmp: str) -> dict[str, Any]:
    """A checkpoint manager over a location of backend ``kind``: steps 1..6 saved every 2 and the newest 2 kept; a
    fresh model restored from it. The step directories left, the newest step, and the restore against the live state."""
    location = _location(kind, tmp)
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    manager = fsdp_optim.CheckpointManager(location, every=2, keep=2)
    for step in range(1, 7):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        manager.save(step, root, optim, extra={"step": step})
    fresh = M.wrap(M.make_net(seed=7), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    restoring = fsdp_optim.CheckpointManager(location, every=2, keep=2)
    extra = restoring.restore(fresh, fresh_optim)
    assert_identical(fresh.state_dict(), root.state_dict(), f"{kind}: weights")
    assert_identical(fresh_optim.state_dict(), optim.state_dict(), f"{kind}: optimizer")
    return {"steps": location.prefixes(), "latest": restoring.latest(), "extra": extra, "from": restoring.restored_from}


def _managed_in_memory(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """The memory tier under a checkpoint manager, one node per rank and a replica of each rank's files on the other
    node: steps 1..6 saved into it (each step a ``NodeMemory`` through the save driver's steps, its commit the
    location's writer's commit) and the newest 2 kept per node; then node 1's memory is lost and a fresh model
    restored (node 1's rank receiving the step's manifest and bytes from node 0 through the location's prefetch)."""
    memory = Path(tmp) / "tier"
    options = {"every": 4, "keep": 2, "memory_every": 1, "replicas": 1, "memory_dir": memory, "keep_memory": 2}
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    manager = fsdp_optim.CheckpointManager(Path(tmp) / "durable", node=str(rank), **options)
    for step in range(1, 7):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        manager.save(step, root, optim, extra={"step": step})
    manager.wait()
    held = sorted(h.step for h in read_holdings(node_dir(memory, str(rank))))
    if rank == 1:  # (its own node's directory: the seals that wrote it are over on this rank)
        shutil.rmtree(node_dir(memory, "1"))
    fresh = M.wrap(M.make_net(seed=7), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    restoring = fsdp_optim.CheckpointManager(Path(tmp) / "durable", node=str(rank), **options)
    extra = restoring.restore(fresh, fresh_optim)
    assert_identical(fresh.state_dict(), root.state_dict(), f"rank {rank}: weights")
    assert_identical(fresh_optim.state_dict(), optim.state_dict(), f"rank {rank}: optimizer")
    return {"held": held, "extra": extra, "from": restoring.restored_from}


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_checkpoint_manager_saves_prunes_and_restores_through_each_backend(kind: str, tmp_path: Path) -> None:
    if kind == "node":
        outs = run_ranks(_managed_in_memory, 2, str(tmp_path))
        assert all(out["held"] == [5, 6] for out in outs), f"each node keeps its newest 2 steps: {outs}"
        assert all(out["extra"] == {"step": 6} and out["from"] == "memory" for out in outs), outs
        return
    (out,) = run_ranks(_managed, 1, kind, str(tmp_path))
    assert out["steps"] == ["step-00000004", "step-00000006"] and out["latest"] == 6, out
    assert out["extra"] == {"step": 6} and out["from"] == "durable", out
