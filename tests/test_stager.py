"""The device-to-host stager: the ring's order and reuse of memory, the one-pass rank-file writer, the async
staging buffers (on any machine, with host copies), and the same on a GPU with CUDA copies (skipped without one)."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
import torch
from _async_copier import AsyncCopier, AsyncEngines, Recorder

from fsdp_optim.core.checksums import ChunkHasher, digests_of_chunks
from fsdp_optim.formats.sharded.ranged import rank_layout, write_rank
from fsdp_optim.formats.sharded.rank_file import host_pieces
from fsdp_optim.job import stager
from fsdp_optim.job.stager import HostCopier, Ring
from fsdp_optim.job.staging import HostStaging, StagedCopy, ready_events

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (copies from GPU memory)")


def _parts(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 300, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def _joined(parts: list[torch.Tensor]) -> bytes:
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def test_chunk_hasher_fed_in_any_split_gives_the_chunk_digests() -> None:
    rng = random.Random(0)
    for trial in range(60):
        whole = torch.cat(_parts(trial)) if trial % 7 else torch.empty(0)
        per = rng.randint(1, 40)
        raw = whole.view(torch.uint8).numpy().tobytes()
        hasher = ChunkHasher("float32", 4, per, whole.numel())
        at = 0
        while at < len(raw):  # pieces that end inside elements and chunks
            step = rng.randint(1, 97)
            hasher.update(memoryview(raw[at : at + step]))
            at += step
        assert hasher.digests() == digests_of_chunks(whole, per), trial
        assert hasher.chunks == len(digests_of_chunks(whole, per)), trial


class _Logged(HostCopier):
    """Host copies that log when each starts and is awaited: the ring's order, seen from outside."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.started = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        super().copy(dst, src)
        self.started += 1
        self.log.append(("copy", self.started))
        return self.started

    def wait(self, ticket: Any) -> None:
        self.log.append(("wait", ticket))


def test_the_ring_streams_every_byte_in_order_through_its_own_reused_buffers() -> None:
    copier = _Logged()
    ring = Ring(copier, slots=3, slot_bytes=64)
    owned = {b.data_ptr() for b in ring.buffers}
    for seed in range(20):
        parts = _parts(seed)
        got = []
        for piece in ring.pieces(parts):
            assert piece.untyped_storage().data_ptr() in owned, "a piece is a view of one of the ring's buffers"
            assert 0 < piece.numel() <= 64
            got.append(piece.numpy().tobytes())  # used before the next is asked for, as the writer does
        assert b"".join(got) == _joined(parts), seed
    assert {b.data_ptr() for b in ring.buffers} == owned, "the ring allocates once, then reuses"


def test_the_ring_keeps_its_slots_in_flight_and_reuses_a_slot_only_after_its_piece_was_used() -> None:
    copier = _Logged()
    ring = Ring(copier, slots=3, slot_bytes=16)
    part = torch.arange(40, dtype=torch.float32)  # 160 bytes: 10 spans of 16
    stream = ring.pieces([part])
    first = next(stream)
    assert copier.log == [("copy", 1), ("copy", 2), ("copy", 3), ("wait", 1)], copier.log  # 3 ahead, then wait
    assert first.numpy().tobytes() == part[:4].numpy().tobytes()
    second = next(stream)  # asking for the next piece hands the first slot back
    assert copier.log[4:] == [("copy", 4), ("wait", 2)], copier.log
    assert second.numpy().tobytes() == part[4:8].numpy().tobytes()
    rest = list(stream)
    assert len(rest) == 8 and {p.data_ptr() for p in rest} == {b.data_ptr() for b in ring.buffers}
    waits = [t for kind, t in copier.log if kind == "wait"]
    assert waits == list(range(1, 11)), "every copy is awaited once, in order"


def test_a_ring_left_early_still_awaits_the_copies_it_started() -> None:
    copier = _Logged()
    ring = Ring(copier, slots=4, slot_bytes=8)
    stream = ring.pieces([torch.zeros(100)])
    next(stream)
    stream.close()  # the writer failed: the slots in flight must be done before the buffers are reused
    started = {t for kind, t in copier.log if kind == "copy"}
    waited = {t for kind, t in copier.log if kind == "wait"}
    assert started == waited == {1, 2, 3, 4}, copier.log  # one used, three in flight: none started after


def test_the_one_pass_writer_writes_the_same_file_whatever_the_pieces() -> None:
    tensors = {"float32": _parts(1), "bfloat16": _parts(2, torch.bfloat16)}
    sizes = {name: sum(p.numel() for p in parts) for name, parts in tensors.items()}
    meta = {"format": "fsdp_optim", "kind": "shard", "version": "3"}
    files = []
    for pieces in (host_pieces, Ring(HostCopier(), slots=2, slot_bytes=24).pieces):
        out = io.BytesIO()
        header = write_rank(out, rank_layout(meta, sizes, 64), tensors, pieces=pieces)
        files.append((header, out.getvalue()))
    assert files[0] == files[1]
    from safetensors import safe_open

    data = files[0][1]
    with open_file(data) as path, safe_open(path, framework="pt") as f:  # any safetensors reader opens it
        assert torch.equal(f.get_tensor("float32"), torch.cat(tensors["float32"]))


class open_file:  # noqa: N801 - a context manager used like open()
    def __init__(self, data: bytes) -> None:
        import tempfile

        self._file = tempfile.NamedTemporaryFile(suffix=".safetensors")
        self._file.write(data)
        self._file.flush()

    def __enter__(self) -> str:
        return self._file.name

    def __exit__(self, *_: Any) -> None:
        self._file.close()


def test_async_staging_reuses_its_buffers_and_says_when_the_copy_is_done() -> None:
    staging = HostStaging()
    state = {0: {"exp_avg": torch.randn(10), "step": torch.tensor(3.0), "note": "x"}, 1: {"w": torch.randn(4)}}
    first = StagedCopy()
    copied = staging.copy(state, {}, first)
    assert first.issued.is_set() and first.staged.is_set() and first.done == []
    assert copied[0]["note"] == "x" and torch.equal(copied[0]["step"], state[0]["step"])
    pointers = {k: copied[k[0]][k[1]].data_ptr() for k in [(0, "exp_avg"), (1, "w")]}
    state[0]["exp_avg"].add_(1)  # the live state moves on; the copy does not
    assert not torch.equal(copied[0]["exp_avg"], state[0]["exp_avg"])
    again = staging.copy(state, {}, StagedCopy())
    assert {k: again[k[0]][k[1]].data_ptr() for k in pointers} == pointers, "the next save reuses the buffers"
    assert torch.equal(again[0]["exp_avg"], state[0]["exp_avg"])


def test_host_tensors_never_go_through_a_ring() -> None:
    part = torch.randn(1000)
    (piece,) = list(stager.pieces([part]))
    assert piece.data_ptr() == part.data_ptr(), "a CPU shard is written where it is, not copied"


@CUDA
def test_gpu_pieces_see_what_the_callers_stream_queued_and_allocate_no_gpu_memory() -> None:
    torch.cuda.synchronize()
    part = torch.zeros(24 << 20, device="cuda")  # 96 MiB: several ring slots
    list(stager.pieces([part]))  # the ring exists from now on
    part.add_(torch.arange(part.numel(), device="cuda", dtype=torch.float32))  # queued, not yet done
    before = torch.cuda.memory_allocated()
    got = b"".join(p.numpy().tobytes() for p in stager.pieces([part]))
    assert torch.cuda.memory_allocated() == before, "staging allocates no GPU memory"
    expected = torch.arange(part.numel(), dtype=torch.float32)
    assert got == expected.numpy().tobytes()
    ring = stager.CUDA.ring(stager.CUDA.copier(part.device))
    assert all(b.is_pinned() for b in ring.buffers)


@CUDA
def test_gpu_async_staging_copies_the_state_at_the_call_and_the_step_waits_on_the_gpu() -> None:
    import threading

    staging = HostStaging()
    live = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    state = {0: {"exp_avg": live}}
    torch.cuda._sleep(100_000_000)  # a long kernel on the caller's stream: what comes after it is still queued
    live.fill_(1.0)  # the state at the call, not yet computed when the save is called
    done, copies = StagedCopy(), []
    ready = ready_events(state)  # the caller's thread, at the call
    thread = threading.Thread(target=lambda: copies.append(staging.copy(state, ready, done)))
    thread.start()
    done.before_change()  # what optim.step() does first: returns once enqueued; its stream waits on the GPU
    live.fill_(2.0)  # the step changes the state in place
    thread.join()
    torch.cuda.synchronize()
    (copied,) = copies
    assert copied[0]["exp_avg"].is_pinned()
    assert torch.all(copied[0]["exp_avg"] == 1.0), "the copy holds the state as it was at the call"
    again = staging.copy(state, ready_events(state), StagedCopy())
    assert again[0]["exp_avg"].data_ptr() == copied[0]["exp_avg"].data_ptr(), "the next save reuses the arena"


def test_the_ring_uploads_every_byte_into_its_destination_and_refuses_a_mismatch() -> None:
    copier = _Logged()
    ring = Ring(copier, slots=2, slot_bytes=40)
    sources = [t for t in _parts(5) if t.numel()] + [torch.arange(7, dtype=torch.int64), torch.tensor(2.5)]
    targets = [torch.empty_like(t) for t in sources]
    ring.upload(list(zip(targets, sources, strict=True)))
    for got, want in zip(targets, sources, strict=True):
        assert torch.equal(got, want)
    copies = [t for kind, t in copier.log if kind == "copy"]
    waits = [t for kind, t in copier.log if kind == "wait"]
    assert waits[-1] == copies[-1], "the upload returns once its last copy is done"
    # A slot is refilled only after the copy out of it was awaited: with 2 slots, copy k+2 waits for copy k.
    for k in copies[2:]:
        assert copier.log.index(("wait", k - 2)) < copier.log.index(("copy", k)), copier.log
    with pytest.raises(ValueError, match=r"live tensor 0: expected \(2,\) torch.float32 .*found \(3,\) torch.float32"):
        ring.upload([(torch.empty(2), torch.zeros(3))])


def test_loaded_optimizer_state_already_on_its_parameters_device_becomes_the_state_as_it_is() -> None:
    """One rule on every device (job/ring_load.py): a loaded tensor in memory of its own on its parameter's device
    (here the host) becomes the state, not copied into the live tensor (a copy of the whole state that lowers no
    peak: the engine A/B measured loads 1.5-2.8x slower while it was copied); the live tensors are left as they were."""
    from fsdp_optim.job.ring_load import optimizer_state_on_device

    net = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 3)).sum().backward()
    optim.step()
    live = {(pid, k): (v, v.clone()) for pid, e in optim.state_dict()["state"].items() for k, v in e.items() if v.dim()}
    loaded = {pid: {k: v + 1 if v.dim() else v for k, v in e.items()} for pid, e in optim.state_dict()["state"].items()}
    ready = optimizer_state_on_device(optim, {**optim.state_dict(), "state": loaded})
    optim.load_state_dict(ready)
    for (pid, key), (tensor, before) in live.items():
        now = optim.state_dict()["state"][pid][key]
        assert now is loaded[pid][key], f"{pid}.{key}: the loaded host tensor is not the state"
        assert torch.equal(tensor, before), f"{pid}.{key}: the old live tensor was written"


def _gpu_round_trip(rank: int, world_size: int, out: str) -> dict[str, Any]:  # noqa: ARG001
    import _models as M

    import fsdp_optim

    torch.manual_seed(0)
    model = M.wrap(M.make_net().cuda(), "deep")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        M.train_step(model, optim, *(t.cuda() for t in M.local_batch(step, rank, world_size)))
    at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handle = fsdp_optim.async_save_checkpoint(model, optim, f"{out}/async", extra={"step": 3})
    M.train_step(model, optim, *(t.cuda() for t in M.local_batch(3, rank, world_size)))  # steps at once
    handle.wait()
    fsdp_optim.save_checkpoint(model, optim, f"{out}/sync", extra={"step": 4})
    live = optim.state_dict()["state"]
    after = {pid: {k: v.clone() for k, v in e.items()} for pid, e in live.items()}  # not the tensors a load reuses
    pointers = {(pid, k): v.data_ptr() for pid, e in live.items() for k, v in e.items() if v.dim()}
    fsdp_optim.load_checkpoint(model, optim, f"{out}/async")
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reused = all(optim.state_dict()["state"][pid][k].data_ptr() == p for (pid, k), p in pointers.items())
    fsdp_optim.load_checkpoint(model, optim, f"{out}/sync")
    back = optim.state_dict()
    same = all(torch.equal(back["state"][pid][k].cpu(), v.cpu()) for pid, e in after.items() for k, v in e.items())
    return {"at call": all(torch.equal(loaded[k], v) for k, v in at_save.items()), "reused": reused, "sync": same}


@CUDA
def test_gpu_saves_and_loads_are_exact_and_load_into_the_live_state(tmp_path) -> None:
    from _dist import run_ranks

    (result,) = run_ranks(_gpu_round_trip, 1, str(tmp_path), backend="nccl")
    assert result == {"at call": True, "reused": True, "sync": True}, result


# -- under an asynchronous copier: copies that land later, on a thread of their own (tests/_async_copier.py) --------


def test_under_async_copies_the_ring_yields_each_piece_only_once_its_copy_has_landed() -> None:
    for seed in range(6):
        engines = AsyncEngines(AsyncCopier(seed=seed), slots=3, slot_bytes=48)
        parts = [engines.place(p) for p in _parts(seed + 40)]
        got = [piece.numpy().tobytes() for piece in stager.pieces(parts, engines=engines)]
        assert b"".join(got) == _joined(parts), f"seed {seed}: the pieces hold the parts' bytes, in order"


def test_under_async_copies_a_ring_left_early_returns_only_once_its_copies_have_landed() -> None:
    copier = AsyncCopier(max_delay=0.01)
    engines = AsyncEngines(copier, slots=4, slot_bytes=8)
    stream = stager.pieces([engines.place(torch.zeros(100))], engines=engines)
    next(stream)
    stream.close()
    assert copier.in_flight() == 0, f"{copier.in_flight()} copies still writing into the ring's reused slots"


def test_under_async_copies_an_upload_returns_once_every_byte_is_in_place() -> None:
    for seed in range(6):
        copier = AsyncCopier(seed=seed)
        engines = AsyncEngines(copier, slots=2, slot_bytes=40)
        sources = [t for t in _parts(seed + 7) if t.numel()] + [torch.arange(7), torch.tensor(2.5)]
        targets = [engines.place(torch.full_like(t, -1)) for t in sources]
        stager.upload(list(zip(targets, sources, strict=True)), engines=engines)
        assert copier.in_flight() == 0, f"seed {seed}: the upload returned with copies still in flight"
        for got, want in zip(targets, sources, strict=True):
            assert torch.equal(got, want), f"seed {seed}: a destination does not hold its source's bytes"


def _async_save(staging: HostStaging, state: dict[int, dict[str, Any]], engines: AsyncEngines) -> tuple[StagedCopy, list]:
    """What an async save does: the mark in the caller's thread, the copy in a thread of its own."""
    import threading

    staged, copies = StagedCopy(), []
    ready = ready_events(state, engines)
    thread = threading.Thread(target=lambda: copies.append(staging.copy(state, ready, staged)))
    thread.start()
    staged.issued.wait(30)
    return staged, [thread, copies]


def test_under_async_copies_the_staging_holds_the_state_at_the_call_when_the_step_changes_it_at_once() -> None:
    for seed in range(4):
        engines = AsyncEngines(AsyncCopier(seed=seed, max_delay=0.005))
        staging = HostStaging(engines, Recorder())
        live = {0: {"exp_avg": engines.place(torch.randn(300)), "step": torch.tensor(3.0)}, 1: {"w": engines.place(torch.randn(50))}}
        at_call = {i: {k: v.clone() for k, v in e.items()} for i, e in live.items()}
        staged, (thread, copies) = _async_save(staging, live, engines)
        staged.before_change()  # what optim.step() does first
        for entries in live.values():
            for value in entries.values():
                value.add_(1)  # the step changes the state in place
        thread.join(30)
        (copied,) = copies
        for i, entries in at_call.items():
            for key, value in entries.items():
                assert torch.equal(copied[i][key], value), f"seed {seed}: {i}/{key} is not the state at the call"


def test_pieces_on_two_devices_are_refused_before_a_copy_is_queued() -> None:
    first, second = AsyncCopier("fake:0"), AsyncCopier("fake:1")
    engines = AsyncEngines(first, second)
    parts = [engines.place(torch.randn(10), 0), engines.place(torch.randn(10), 1)]
    with pytest.raises(ValueError, match=r"on several devices.*fake:0.*fake:1"):
        list(stager.pieces(parts, engines=engines))
    assert first.queued == second.queued == 0, "nothing was copied before the refusal"


def _live(engines: AsyncEngines, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [engines.place(torch.full(s, -1.0)) for s in shapes]


def test_an_upload_into_a_non_contiguous_live_tensor_lands_every_byte() -> None:
    engines = AsyncEngines(AsyncCopier(max_delay=0.001), slots=2, slot_bytes=16)
    first, strided, last = _live(engines, (5,), (4, 6), (7,))
    sources = [torch.arange(5.0), torch.arange(24.0).reshape(4, 6).t(), torch.arange(7.0)]
    strided = strided.t()  # a live tensor that is a transposed view
    stager.upload([(first, sources[0]), (strided, sources[1]), (last, sources[2])], engines=engines)
    for got, want in zip([first, strided, last], sources, strict=True):
        assert torch.equal(got, want), "every destination holds its source, the strided one too"


@pytest.mark.parametrize(
    ("live", "source", "found"),
    [
        (torch.empty(2, 3), torch.zeros(3, 2), r"\(2, 3\) torch.float32.*found \(3, 2\) torch.float32"),
        (torch.empty(6), torch.zeros(6, dtype=torch.int32), r"\(6,\) torch.float32.*found \(6,\) torch.int32"),
        (torch.empty(6), torch.zeros(7), r"\(6,\) torch.float32.*found \(7,\) torch.float32"),
    ],
)
def test_an_upload_refuses_a_mismatch_before_the_first_byte_is_written(live, source, found) -> None:
    copier = AsyncCopier()
    engines = AsyncEngines(copier, slots=2, slot_bytes=16)
    earlier, on_host = _live(engines, (9,)), torch.full((3,), -1.0)
    engines.place(live)
    pairs = [(earlier[0], torch.zeros(9)), (on_host, torch.zeros(3)), (live, source)]
    with pytest.raises(ValueError, match=rf"live tensor 2: expected {found}"):
        stager.upload(pairs, engines=engines)
    assert copier.queued == 0 and torch.all(earlier[0] == -1) and torch.all(on_host == -1), "nothing was written"


def test_the_ring_checks_every_destination_before_it_copies() -> None:
    copier = AsyncCopier()
    ring = Ring(copier, slots=2, slot_bytes=16)
    good, strided = torch.zeros(8), torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="live tensor 1: expected a contiguous destination"):
        ring.upload([(good, torch.ones(8)), (strided, torch.ones(4, 4))])
    assert copier.queued == 0 and torch.all(good == 0), "nothing was copied before the refusal"


def test_a_staging_copy_that_fails_after_queuing_copies_returns_only_once_they_have_landed() -> None:
    copier = AsyncCopier(max_delay=0.02, fail_at=4)
    engines = AsyncEngines(copier)
    staging = HostStaging(engines, Recorder())
    state = {i: {"exp_avg": engines.place(torch.randn(1000))} for i in range(6)}
    staged = StagedCopy()
    with pytest.raises(RuntimeError, match="copy 4 failed to launch"):
        staging.copy(state, ready_events(state, engines), staged)
    assert copier.in_flight() == 0, f"{copier.in_flight()} copies still writing into the arena after the failure"
    assert staged.issued.is_set(), "a step waiting for the failed copy does not hang"


def _state(engines: AsyncEngines, *sizes: int) -> dict[int, dict[str, Any]]:
    return {i: {"exp_avg": engines.place(torch.randn(n)), "step": torch.tensor(float(i))} for i, n in enumerate(sizes)}


def _staged_equal(copied: dict[int, dict[str, Any]], state: dict[int, dict[str, Any]]) -> bool:
    return all(torch.equal(copied[i][k], v) for i, e in state.items() for k, v in e.items())


class _Destinations(AsyncCopier):
    """Fake copies that note where each lands (its destination's storage)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.into: list[int] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.into.append(dst.untyped_storage().data_ptr())
        return super().copy(dst, src)


def test_a_layouts_first_save_copies_through_the_ring_and_its_arena_is_locked_after_it_in_chunks_then_reused(
    monkeypatch,
) -> None:
    import gc

    from fsdp_optim.job import staging as staging_module

    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 1024)
    copier = _Destinations(max_delay=0.001)
    engines = AsyncEngines(copier)
    registrar = Recorder(copier=copier)
    staging = HostStaging(engines, registrar)
    ring = {b.untyped_storage().data_ptr() for b in engines.ring(copier).buffers}
    state = _state(engines, 700, 300, 900)  # 8.5 KiB of shards, 512-byte aligned: 9 chunks, shards across them
    assert _staged_equal(staging.copy(state, ready_events(state, engines), StagedCopy()), state)
    assert registrar.calls == [], "the first save of a layout page-locks nothing: its copies go through the ring"
    assert set(copier.into) == ring, "every copy of the first save lands in the ring's page-locked slots"
    staging.lock()  # what the save's thread does once its upload is done
    chunks = registrar.registered()
    assert len(chunks) == 9 and all(n <= 1024 for _, n in chunks), f"one chunk at a time: {chunks}"
    assert {d for *_, d, _ in registrar.calls} == {copier.device}, "each chunk is locked for the shards' device"
    copier.into.clear()
    other = _state(engines, 900, 700, 200)  # another layout that fits: the arena and its registration are kept
    assert _staged_equal(staging.copy(other, ready_events(other, engines), StagedCopy()), other)
    assert registrar.registered() == chunks, "a layout that fits the arena registers nothing again"
    assert copier.into and not set(copier.into) & ring, "a locked arena takes its copies straight, not through the ring"
    larger = _state(engines, 3000)
    assert _staged_equal(staging.copy(larger, ready_events(larger, engines), StagedCopy()), larger)
    gc.collect()
    unregistered = {p for kind, p, *_ in registrar.calls if kind == "unregister"}
    assert unregistered == {p for p, _ in chunks}, "the old arena's chunks are unregistered once it is dropped"


class _Slow(Recorder):
    """A registrar whose page-locking (seconds for a large arena) lasts until the test releases it; it notes the
    thread of each call."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.released = threading.Event()
        self.threads: list[str] = []

    def register(self, memory: torch.Tensor, device: torch.device) -> None:
        import threading

        self.threads.append(threading.current_thread().name)
        assert self.released.wait(30), "the test never released the registration"
        super().register(memory, device)


def test_the_first_save_of_a_layout_lets_step_go_on_before_anything_is_page_locked(monkeypatch) -> None:
    """On the first async save of a layout, ``step()`` waited while the arena was page-locked (seconds for
    GiBs); now the copies go through the ring's slots, already locked, and the save's thread locks the arena after."""
    import threading

    from fsdp_optim.job import staging as staging_module

    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 1024)
    copier = AsyncCopier(max_delay=0.002)
    engines = AsyncEngines(copier)
    registrar = _Slow()
    staging = HostStaging(engines, registrar)
    state = _state(engines, 700, 300, 900)
    at_call = {i: {k: v.clone() for k, v in e.items()} for i, e in state.items()}
    staged, copies = StagedCopy(), []
    ready = ready_events(state, engines)  # the caller's thread, at the call

    def save() -> None:  # the save's thread (fsdp_optim.job.async_save.launch): the copy, the upload, the locking
        copies.append(staging.copy(state, ready, staged))
        staging.lock()

    thread = threading.Thread(target=save, name="the-save")
    thread.start()
    try:
        assert staged.issued.wait(10), "step() would wait for the arena's page-locking"
        staged.before_change()  # what optim.step() does first
        for entries in state.values():
            for value in entries.values():
                value.add_(1)  # the step changes the state in place
    finally:
        registrar.released.set()
    thread.join(30)
    (copied,) = copies
    assert _staged_equal(copied, at_call), "the copy holds the state at the call"
    assert len(registrar.registered()) == 9 and set(registrar.threads) == {"the-save"}, registrar.threads
    again = staging.copy(state, ready_events(state, engines), StagedCopy())
    assert _staged_equal(again, state) and len(registrar.registered()) == 9, "a later save registers nothing"


@CUDA
def test_gpu_the_first_save_of_a_layout_lets_step_go_on_before_anything_is_page_locked() -> None:
    import threading

    from fsdp_optim.job import staging as staging_module

    class Slow(staging_module.CudaHost):
        def __init__(self) -> None:
            self.released, self.calls = threading.Event(), 0

        def register(self, memory: torch.Tensor, device: torch.device) -> None:
            assert self.released.wait(60), "the test never released the registration"
            self.calls += 1
            super().register(memory, device)

    registrar = Slow()
    staging = HostStaging(registrar=registrar)
    live = torch.randn(64 << 20, device="cuda")  # 256 MiB: several of the ring's slots
    at_call = live.cpu()
    state, staged, copies = {0: {"exp_avg": live}}, StagedCopy(), []
    ready = ready_events(state)

    def save() -> None:
        copies.append(staging.copy(state, ready, staged))
        staging.lock()

    thread = threading.Thread(target=save)
    thread.start()
    try:
        assert staged.issued.wait(30), "step() would wait for the arena's page-locking"
        staged.before_change()
        live.add_(1.0)  # the step, on the caller's stream
    finally:
        registrar.released.set()
    thread.join(60)
    (copied,) = copies
    assert torch.equal(copied[0]["exp_avg"], at_call), "the copy holds the state at the call"
    assert registrar.calls >= 1 and copied[0]["exp_avg"].is_pinned(), "the arena is page-locked after the save"
    calls = registrar.calls
    again = staging.copy(state, ready_events(state), StagedCopy())
    torch.cuda.synchronize()
    assert torch.equal(again[0]["exp_avg"], live.cpu()) and registrar.calls == calls, "a later save locks nothing"
    assert again[0]["exp_avg"].data_ptr() == copied[0]["exp_avg"].data_ptr(), "and reuses the arena"


@pytest.mark.parametrize("fail_from", [1, 3])
def test_a_registration_that_fails_falls_back_with_one_warning_and_the_copy_is_exact(monkeypatch, fail_from) -> None:
    import threading
    import warnings

    from fsdp_optim.job import staging as staging_module

    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(staging_module, "_warned", threading.Event())
    engines = AsyncEngines(AsyncCopier(max_delay=0.001))
    registrar = Recorder(fail_from=fail_from)
    staging = HostStaging(engines, registrar)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sizes in [(700, 900), (2000, 100), (5000,)]:  # a save, one with a layout that fits, a larger one
            state = _state(engines, *sizes)
            assert _staged_equal(staging.copy(state, ready_events(state, engines), StagedCopy()), state), sizes
            staging.lock()  # as the save's thread does after its upload
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "page-locking failed" in said[0], said
    tries = [kind for kind, *_ in registrar.calls if kind != "unregister"]
    assert tries.count("failed") == 1, f"after a failure no arena tries to page-lock again: {tries}"
    assert len(tries) == fail_from, tries


@pytest.mark.parametrize("fail_from", [1, 3])
def test_a_failed_registration_clears_the_error_it_left_before_the_save_goes_on(monkeypatch, fail_from) -> None:
    """A failed ``cudaHostRegister`` leaves the runtime's last error set; the next kernel launch on the save's thread
    would fail for it. The arena clears it (the registrar's ``clear_error``) before it falls back."""
    import threading
    import warnings

    from fsdp_optim.job import staging as staging_module

    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(staging_module, "_warned", threading.Event())
    engines = AsyncEngines(AsyncCopier(max_delay=0.001))
    registrar = Recorder(fail_from=fail_from)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, staging = _state(engines, 3000), HostStaging(engines, registrar)
        assert _staged_equal(staging.copy(state, ready_events(state, engines), StagedCopy()), state)
        staging.lock()
    assert any(kind == "failed" for kind, *_ in registrar.calls), registrar.calls
    assert registrar.last_error == 0 and registrar.cleared == 1, (registrar.last_error, registrar.cleared)


@CUDA
def test_gpu_a_failed_registration_leaves_no_error_for_the_next_kernel_launch() -> None:
    import warnings

    from fsdp_optim.job.staging import CUDA_HOST, Arena

    device = torch.device("cuda", 0)
    memory = torch.empty(1 << 20, dtype=torch.uint8)
    CUDA_HOST.register(memory, device)  # registering it again fails (already registered), as a locked limit would
    try:
        arena = Arena(memory, device, CUDA_HOST)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arena.lock_through(memory.numel())
        assert arena.failed, "the second registration of the same memory fails"
        doubled = torch.ones(4, device=device) * 2  # a kernel launch: its launch check reads the last error
        torch.cuda.synchronize()
        assert doubled.sum().item() == 8, doubled
    finally:
        CUDA_HOST.unregister(memory.data_ptr(), device)


def test_the_save_thread_binds_the_shards_device_before_it_locks_or_copies() -> None:
    import threading

    seen: list[tuple[str, str]] = []

    class Bound(AsyncCopier):
        def bind(self) -> None:
            seen.append(("bind", threading.current_thread().name))

        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
            seen.append(("copy", threading.current_thread().name))
            return super().copy(dst, src)

    engines = AsyncEngines(Bound())
    state = _state(engines, 100)
    staged, (thread, copies) = _async_save(HostStaging(engines, Recorder()), state, engines)
    thread.join(30)
    assert seen[0] == ("bind", thread.name) and ("copy", thread.name) in seen, seen


@CUDA
def test_gpu_staging_locks_in_chunks_on_the_shards_gpu_from_the_save_thread_and_falls_back_when_it_cannot(
    monkeypatch,
) -> None:
    import threading

    from fsdp_optim.job import staging as staging_module

    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(staging_module, "_warned", threading.Event())
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # not GPU 0 where there are several
    seen: list[int] = []

    class Watched(staging_module.CudaHost):
        def register(self, memory: torch.Tensor, device: torch.device) -> None:
            seen.append(torch.cuda.current_device())
            super().register(memory, device)

    class Failing(staging_module.CudaHost):
        def register(self, memory: torch.Tensor, device: torch.device) -> None:
            raise RuntimeError("cudaHostRegister is not supported here")

    for registrar in (Watched(), Failing()):
        live = torch.randn(3 << 20, device=device)  # 12 MiB: 12 chunks
        state, staged, copies = {0: {"exp_avg": live}}, StagedCopy(), []
        staging = HostStaging(registrar=registrar)
        ready = ready_events(state)

        def save() -> None:  # the copy, then the locking, on the save's thread (launch)
            copies.append(staging.copy(state, ready, staged))  # noqa: B023
            staging.lock()  # noqa: B023

        thread = threading.Thread(target=save)
        thread.start()
        thread.join(60)
        copies.append(staging.copy(state, ready_events(state), StagedCopy()))  # a later save
        for copied in copies:
            assert torch.equal(copied[0]["exp_avg"], live.cpu()), type(registrar).__name__
        assert copies[1][0]["exp_avg"].is_pinned(), f"{type(registrar).__name__}: a later save's arena is page-locked"
    assert len(seen) == 12 and set(seen) == {device.index}, f"registered on the shards' GPU, in chunks: {seen}"


def test_into_live_casts_floating_point_only_and_refuses_any_other_dtype_before_writing() -> None:
    from fsdp_optim.job.ring_load import into_live

    half, ints = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"live tensor 1: expected \(3,\) torch.int32 .*found \(3,\) torch.int64"):
        into_live([(half, torch.ones(4)), (ints, torch.tensor([1, 2, 3]))])
    assert torch.all(half == 0) and torch.all(ints == 0), "nothing was written"
    into_live([(half, torch.ones(4))])
    assert torch.all(half == 1), "a float32 host tensor is cast into a bfloat16 live one"


@CUDA
def test_gpu_upload_lands_strided_and_contiguous_tensors_and_refuses_a_mismatch_before_writing() -> None:
    live = [torch.full((5,), -1.0, device="cuda"), torch.full((4, 6), -1.0, device="cuda").t()]
    sources = [torch.arange(5.0), torch.arange(24.0).reshape(4, 6).t()]
    stager.upload(list(zip(live, sources, strict=True)))
    torch.cuda.synchronize()
    assert all(torch.equal(got.cpu(), want) for got, want in zip(live, sources, strict=True))
    with pytest.raises(ValueError, match="live tensor 1: expected"):
        stager.upload([(live[0], torch.zeros(5)), (live[1], torch.zeros(24))])
    assert torch.equal(live[0].cpu(), sources[0]), "nothing was written before the refusal"
    if torch.cuda.device_count() > 1:
        parts = [torch.zeros(4, device="cuda:0"), torch.zeros(4, device="cuda:1")]
        with pytest.raises(ValueError, match="on several devices"):
            list(stager.pieces(parts))


# -- an async save's buffers and extra: copied through the root's staging on the save's copy engine, never read ----
# -- on the host in the caller (issue 47) ----------------------------------------------------------------------------


def _net_with_buffer(n: int, device: str = "cpu") -> Any:
    import fsdp_optim

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    net.register_buffer("stat", torch.randn(n))
    root = fsdp_optim.FullyShardedDataParallel(net.to(device))
    optim = torch.optim.Adam(root.parameters(), lr=1e-2, capturable=device != "cpu")
    root(torch.randn(2, 8, device=device)).sum().backward()
    optim.step()
    return root, optim


def _side_tensors_on_a_fake_device(rank: int, world_size: int, out: str) -> dict[str, bool]:  # noqa: ARG001
    import fsdp_optim
    from fsdp_optim.job import async_save

    copier = AsyncCopier(max_delay=0.002)
    engines = AsyncEngines(copier)
    root, optim = _net_with_buffer(300)
    stat = engines.place(root.module.stat)  # the buffer and an extra tensor sit on the fake device
    extra = {"step": 1, "t": engines.place(torch.randn(500))}
    async_save._staging[root] = HostStaging(engines, Recorder(copier=copier))  # the root's staging, on that device
    at_call = (stat.clone(), extra["t"].clone())
    handle = fsdp_optim.async_save_checkpoint(root, optim, out, extra=extra)
    stat.add_(1)  # a forward changes the buffer in place right after the call; the loop its extra
    extra["t"].add_(1)
    handle.wait()
    through = copier.bytes_landed == (300 + 500) * 4
    back = fsdp_optim.load_checkpoint(root, optim, out)
    return {"through the engine": through, "buffer": torch.equal(root.module.stat, at_call[0]),
            "extra": torch.equal(back["t"], at_call[1])}  # fmt: skip


def test_an_async_saves_buffers_and_extra_on_a_device_go_through_its_copy_engine_and_hold_the_state_at_the_call(
    tmp_path,
) -> None:
    from _dist import run_ranks

    (result,) = run_ranks(_side_tensors_on_a_fake_device, 1, str(tmp_path))
    assert result == {"through the engine": True, "buffer": True, "extra": True}, result


def _gpu_side_tensors_queued_only(rank: int, world_size: int, out: str) -> dict[str, bool]:  # noqa: ARG001
    import fsdp_optim

    root, optim = _net_with_buffer(1 << 20, "cuda")  # 4 MiB buffer
    extra = {"step": 1, "t": torch.randn(1 << 20, device="cuda")}
    fsdp_optim.async_save_checkpoint(root, optim, f"{out}/warm", extra=extra).wait()  # groups and staging made once
    at_call = (root.module.stat.cpu(), extra["t"].cpu())
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # about 2 s of queued GPU work on the caller's stream
    handle = fsdp_optim.async_save_checkpoint(root, optim, f"{out}/async", extra=extra)
    queued = not stream.query()  # the call returned while the GPU still ran what came before it
    root.module.stat.add_(1)  # a forward's in-place change, queued right after the call
    extra["t"].add_(1)
    handle.wait()
    back = fsdp_optim.load_checkpoint(root, optim, f"{out}/async")
    return {"still queued after the call": queued, "buffer": torch.equal(root.module.stat.cpu(), at_call[0]),
            "extra": torch.equal(back["t"].cpu(), at_call[1])}  # fmt: skip


@CUDA
def test_gpu_an_async_saves_gpu_buffers_and_extra_are_queued_on_the_save_stream_not_read_in_the_call(tmp_path) -> None:
    from _dist import run_ranks

    (result,) = run_ranks(_gpu_side_tensors_queued_only, 1, str(tmp_path), backend="nccl")
    assert result == {"still queued after the call": True, "buffer": True, "extra": True}, result
