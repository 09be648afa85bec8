"""The memory tier of CheckpointManager: whole checkpoints in each node's host memory, replicated on
other nodes, restored after a failure at any world size, with real processes and real SIGKILLs.

"Nodes" are groups of processes on this machine, each with its own directory under one memory directory in
/dev/shm (``node=`` names a rank's node); losing a node is SIGKILLing its ranks and removing its directory.

One 6-rank job (3 nodes x 2 ranks, replicas=1) trains steps 1..6 saving to memory every 2 steps and to disk every 4,
then the ranks of node 1 SIGKILL themselves. Each scenario restores from a copy of what the nodes' memory held:
fewer, the same and more ranks without node 1 (memory step 6, bit-identical to the state at step 6), the same ranks
after losing one rank only, after losing nodes 1 and 2 (replicas=1: nothing whole survives, the durable step 4
is restored, saying so), and after losing node 1 with a byte of a surviving replica flipped (every rank refuses
it by checksum; the durable step 4 is restored, saying so). A second job is killed mid-save of step 6 on one node: step 4 restores.
"""

from __future__ import annotations

import os
import shutil
import signal
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from _checks import assert_identical
from _dist import run_ranks, write_whole

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.core.memory_plan import Fetch, Holding, choose_step, fetch_plan, replica_peers
from fsdp_optim.formats.sharded.byte_ranges import join_overlapping
from fsdp_optim.formats.sharded.memory_tier import read_holdings

EVERY, MEMORY_EVERY, STOP = 4, 2, 6
NODES = ["0", "0", "1", "1", "2", "2"]  # job 1: 3 nodes x 2 ranks


def _manager(root: str, memory: str, node: str) -> fsdp_optim.CheckpointManager:
    return fsdp_optim.CheckpointManager(
        root, every=EVERY, keep=2, memory_every=MEMORY_EVERY, replicas=1, memory_dir=memory, node=node
    )


def _state(model: Any, optim: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": model.gather_full_optim_state_dict(optim)}


def _die_mid_save() -> None:
    """The next memory-tier save dies on this rank once its own files are written, before any replica moves."""
    import fsdp_optim.job.node_memory as node_memory

    def die(*_: Any, **__: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    node_memory.exchange_bytes = die  # type: ignore[assignment]


def _train(rank: int, world_size: int, root: str, memory: str, lost: list[str], die_at: int | None) -> None:
    manager = _manager(root, memory, NODES[rank])
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    for step in range(1, STOP + 1):
        M.train_step(model, optim, *M.local_batch(step - 1, rank, world_size))
        if step == die_at and NODES[rank] in lost:
            _die_mid_save()
        manager.save(step, model, optim, extra={"step": step, "rank": rank})
        if step % MEMORY_EVERY == 0:
            manager.wait()
            state = _state(model, optim)  # collectives: every rank
            if rank == 0:
                Path(root).mkdir(parents=True, exist_ok=True)
                write_whole(Path(root) / f"reference-{step}.pt", lambda f: torch.save(state, f))
            dist.barrier()  # the reference written before a lost node's ranks kill themselves (and the job rank 0)
    manager.wait()
    assert manager.memory_bytes is not None and manager.memory_bytes > 0, manager.memory_bytes
    if NODES[rank] in lost:
        os.kill(os.getpid(), signal.SIGKILL)


def _restore(rank: int, world_size: int, root: str, memory: str, nodes: list[str], nesting: str) -> dict[str, Any]:
    manager = _manager(root, memory, nodes[rank])
    model = M.wrap(M.make_net(123), nesting)  # another init: the restore must win
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = manager.restore(model, optim)
    state = _state(model, optim)
    said = [str(w.message) for w in caught]
    out = {"extra": extra, "from": manager.restored_from, "step": manager.restored_step, "warnings": said}
    return {**out, **(state if rank == 0 else {})}


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"fsdp_optim-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """Job 1, its node 1 SIGKILLed after the memory save of step 6: (durable root, memory directory)."""
    root = tmp_path_factory.mktemp("memtier") / "ckpt"
    memory = Path("/dev/shm") / f"fsdp_optim-test-{uuid.uuid4().hex[:12]}"
    try:
        with pytest.raises(AssertionError, match="rank 2: exited without a result"):
            run_ranks(_train, len(NODES), str(root), str(memory), ["1"], None)
        yield root, memory
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def _check(results: list[dict[str, Any]], root: Path, source: str, step: int) -> None:
    for rank, result in enumerate(results):
        assert (result["from"], result["step"]) == (source, step), (rank, result["from"], result["step"])
        assert result["extra"]["step"] == step and result["extra"]["rank"] == rank % len(NODES), result["extra"]
    reference = torch.load(root / f"reference-{step}.pt", weights_only=False)
    first = results[0]
    for key in reference["model"]:
        assert_identical(first["model"][key], reference["model"][key], key)
    content = lambda full: {k: v for k, v in full.items() if k != "fsdp_optim"}  # noqa: E731 - header: world size
    assert_identical(content(first["optim"]), content(reference["optim"]), "optim")


def _scenario(trained: tuple[Path, Path], shm: Path, lost: list[str]) -> tuple[Path, Path]:
    root, memory = trained
    shutil.copytree(memory, shm)
    for node in lost:
        shutil.rmtree(shm / f"node-{node}")
    return root, shm


def test_lose_a_node_restore_at_fewer_ranks(trained: tuple[Path, Path], shm: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    root, memory = _scenario(trained, shm, ["1"])
    assert main(["list", str(root), "--quick", "--memory-dir", str(memory)]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory")]
    # steps 4 and 6 kept on nodes 0 and 2, each holding its own 2 ranks' files and node 1's or 2's replicas
    assert [line.split()[1:4] for line in listed] == [["node-0", "step", "6"], ["node-0", "step", "4"],
                                                       ["node-2", "step", "6"], ["node-2", "step", "4"]], listed  # fmt: skip
    assert all("holds 8 of 12 files" in line for line in listed), listed
    results = run_ranks(_restore, 4, str(root), str(memory), ["0", "0", "2", "2"], "deep")
    _check(results, root, "memory", 6)
    assert not any(r["warnings"] for r in results), results[0]["warnings"]


def test_lose_two_nodes_falls_back_to_durable(trained: tuple[Path, Path], shm: Path) -> None:
    root, memory = _scenario(trained, shm, ["1", "2"])
    results = run_ranks(_restore, 2, str(root), str(memory), ["0", "0"], "deep")
    _check(results, root, "durable", 4)
    said = "\n".join(results[0]["warnings"])
    assert "no step survives whole in the memory tiers of the 1 live nodes" in said, said


def test_damaged_replica_falls_back_to_durable(trained: tuple[Path, Path], shm: Path) -> None:
    root, memory = _scenario(trained, shm, ["1"])
    # node 1's rank 2: after the loss, node 2's replica is its only copy, and the 4-rank restore reads all of it
    (step,) = [d for d in (memory / "node-2").iterdir() if d.name.startswith("step-00000006")]
    (victim,) = step.glob("optim-*-rank00002-of-00006.safetensors")
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    results = run_ranks(_restore, 4, str(root), str(memory), ["0", "0", "2", "2"], "deep")
    _check(results, root, "durable", 4)
    said = "\n".join(results[0]["warnings"])
    assert "could not be restored" in said and "checksum mismatch" in said and "durable step 4" in said, said


@pytest.mark.slow
@pytest.mark.parametrize(
    "lost, nodes, nesting",
    [
        ([], NODES, "deep"),  # one rank SIGKILLed (its node's memory kept): the same world size
        (["1"], ["0", "0", "2", "2", "3", "3"], "shallow"),  # a new node in its place, another nesting
        (["1"], ["0", "0", "2", "2", "3", "3", "4", "4"], "deep"),  # more ranks than saved
    ],
    ids=["lose_rank_same_W", "lose_node_same_W", "lose_node_more_W"],
)
def test_restore_from_memory(trained: tuple[Path, Path], shm: Path, lost: list[str], nodes: list[str],
                             nesting: str) -> None:  # fmt: skip
    root, memory = _scenario(trained, shm, lost)
    results = run_ranks(_restore, len(nodes), str(root), str(memory), nodes, nesting)
    _check(results, root, "memory", 6)


@pytest.mark.slow
def test_lose_a_node_mid_save_restores_the_previous_step(tmp_path: Path, shm: Path) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_train, len(NODES), str(root), str(shm), ["1"], STOP, timeout_s=15)
    shutil.rmtree(shm / "node-1")
    assert [h.step for h in read_holdings(shm / "node-0")] == [4, 2], "step 6 never became visible"
    results = run_ranks(_restore, 4, str(root), str(shm), ["0", "0", "2", "2"], "deep")
    _check(results, root, "memory", 4)


# ---- the pure rules


def test_replica_peers_and_choice() -> None:
    assert replica_peers(NODES, 1) == ((2,), (3,), (4,), (5,), (0,), (1,))
    assert replica_peers(NODES, 5) == ((2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3))  # at most nodes - 1
    assert replica_peers(["a", "a"], 1) == ((), ())
    files = (("a", 1), ("b", 2))
    old = Holding(2, "s2", "d2", 2, files, frozenset({"a", "b"}))
    part = Holding(4, "s4", "d4", 2, files, frozenset({"a"}))
    rest = Holding(4, "s4", "d4", 2, files, frozenset({"b"}))
    assert choose_step([[part, old], [old]]) is not None and choose_step([[part, old], [old]]).step == 2  # type: ignore[union-attr]
    chosen = choose_step([[part, old], [rest]])
    assert chosen is not None and chosen.step == 4 and chosen.holder_ranks() == {"a": (0,), "b": (1,)}
    assert choose_step([[part]]) is None
    needs = [[("b", 1, 2), ("a", 0, 1), ("b", 0, 1)], [("a", 0, 1), ("b", 0, 2)], [("b", 1, 2)]]
    fetches = fetch_plan(chosen, ["x", "y", "z"], needs, {"x": frozenset({"a"}), "y": frozenset({"b"})})
    # each node's missing ranges in the order its load uses them, from the holder that has sent the least
    assert fetches == (Fetch(1, 0, "b", 1, 2), Fetch(1, 0, "b", 0, 1), Fetch(0, 1, "a", 0, 1), Fetch(1, 2, "b", 1, 2))
    both = Holding(4, "s4", "d4", 2, files, frozenset({"a", "b"}))
    shared = choose_step([[both], [both], []])
    assert shared is not None and [f.src for f in fetch_plan(shared, ["x", "x", "z"], [[], [], needs[0]], {})] == [
        0, 1, 0], "the holders share the sending"  # fmt: skip


def test_byte_ranges_join_overlapping_only() -> None:
    # (start, stop, first use): a shared chunk is received once; touching ranges stay pieces of their own
    spans = [(5, 9, 3), (0, 2, 1), (2, 4, 0), (8, 12, 2), (20, 20, 5)]
    assert join_overlapping(spans) == [(0, 2, 1), (2, 4, 0), (5, 12, 2)]
