"""Loads onto a device. Where loaded state lands, one rule on every device: the device never holds the state twice
past the load. Parameters and buffers land in the live tensors, in place (FSDP's flat parameters must keep their
storage). The optimizer's state lands in its live tensors where the loaded bytes cross devices (host tensors into GPU
ones, through the stager's pinned ring, never through pageable memory); a loaded tensor already in memory of its own
on its parameter's device becomes the state as it is (a copy would cost and save nothing).

Loads at the floor: a rank file read a piece at a time straight into the slots of the GPU's pinned ring, each
piece's chunk checksums checked on its slot, then copied to the GPU from there, while a reader thread fills the next
slots. Nothing the size of the state passes through pageable memory.

A whole load at the saved layout goes through the ring twice, so that the GPU never holds the state twice
(:func:`verify_own`, then :meth:`Verified.land`): the first pass reads and checks every piece in the slots and keeps
nothing; the ranks agree; the second reads and checks each piece again and copies it straight into the live tensor
it lands in. A corrupt byte, or a failure on another rank, leaves every live tensor as it was; the cost is the file
read and hashed twice (the second time usually from the page cache). A mismatch in the second pass (the file changed
between the passes) raises, naming the file, after part of the live state was written. :func:`read_own` (the
scatter's loads, and a load into host memory) reads once into new memory.

Threads: the reader (``preadv``) waits for a slot's previous copies to be done before it refills it; the checker
hashes the slot the reader filled before (xxhash; both release the GIL); the caller's thread queues each checked
piece's copies and hands the slot back with their tickets. Each slot is read, checked and copied in turn, the three
at work on three slots at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.disk.location import Location
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.piece_reads import TensorPiece, plan_pieces
from fsdp_optim.formats.sharded.rank_file import RankFile
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint, open_checkpoint
from fsdp_optim.job.stager import CUDA, Ring, check_pairs, upload
from fsdp_optim.job.staging import before_change

__all__ = [
    "Destination", "Verified", "into_live", "live_destination", "optimizer_state_on_device", "read_own", "ring_for",
    "stream_pieces", "verify_own",
]  # fmt: skip

Copies = Callable[[TensorPiece, torch.Tensor], Iterator[tuple[torch.Tensor, torch.Tensor]]]
# (flat, key, numel, dtype, device) -> the 1-D contiguous tensor a shard lands in
Destination = Callable[[int, str, int, torch.dtype, torch.device], torch.Tensor]
Stage = Callable[[TensorPiece, torch.Tensor], None]
_Queue = queue.Queue  # of (slot, piece), a failure, or None (no more); free slots: (slot, their copies' tickets)


def ring_for(device: torch.device) -> Ring | None:
    """The ring a load into ``device`` streams through: that GPU's pinned ring; none for host memory (a load into
    host tensors reads straight into them). Tests run the ring's path on the host by answering a host ring here."""
    return CUDA.ring(CUDA.copier(device)) if device.type == "cuda" else None


@dataclass(frozen=True)
class Verified:
    """Rank ``rank``'s own file of the checkpoint at ``directory``, every piece read through the ring and checked
    (:func:`verify_own`), nothing kept."""

    directory: Location
    rank: int
    devices: tuple[torch.device, ...]
    want: Callable[[int, str], bool]

    def land(self, destination: Destination) -> dict[int, dict[str, Any]]:
        """The file read again through the ring, each piece checked again and copied straight into the tensor
        ``destination`` gives its shard: :func:`read_own`'s result, its shards those tensors."""
        with open_checkpoint(self.directory) as ckpt:
            return read_own(ckpt, self.rank, self.devices, self.want, destination)


def verify_own(
    ckpt: ShardedCheckpoint, rank: int, devices: Sequence[torch.device], want: Callable[[int, str], bool]
) -> Verified | None:
    """The first pass of a load at the saved layout through a ring (module doc): every piece checked in the slots,
    nothing kept; ``ValueError`` at a checksum mismatch. None where no ring is used (host memory, format 1 or 2
    files): :func:`read_own` reads those once, into new memory."""
    ring, rank_file = _ring_and_file(ckpt, rank, devices)
    if ring is None or rank_file is None:
        return None
    try:
        stream_pieces(ring, plan_pieces(rank_file, ring.slot_bytes), _stages(rank_file), _no_copies)
    finally:
        rank_file.release()
    return Verified(ckpt.directory, rank, tuple(devices), want)


def _ring_and_file(
    ckpt: ShardedCheckpoint, rank: int, devices: Sequence[torch.device]
) -> tuple[Ring | None, RankFile | None]:
    device = devices[0] if devices and all(d == devices[0] for d in devices) else None
    ring = ring_for(device) if device is not None else None
    rank_file = ckpt.rank_file(rank)
    usable = ring is not None and rank_file is not None and ckpt.manifest.version >= 3
    return (ring, rank_file) if usable else (None, None)


def _stages(rank_file: RankFile) -> list[Stage]:
    """A piece read into its slot, then checked there: one thread each, overlapped."""
    return [lambda p, slot: rank_file.read_chunks(p.tensor, p.lo, p.hi, slot.view(p.dtype)),
            lambda p, slot: rank_file.check_chunks(p.tensor, p.lo, slot.view(p.dtype))]  # fmt: skip


def _no_copies(piece: TensorPiece, slot: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ARG001
    return iter(())


def _new(flat: int, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ARG001
    return torch.empty(numel, dtype=dtype, device=device)


def read_own(
    ckpt: ShardedCheckpoint,
    rank: int,
    devices: Sequence[torch.device],
    want: Callable[[int, str], bool],
    destination: Destination = _new,
) -> dict[int, dict[str, Any]]:
    """Rank ``rank``'s own file at the saved layout: ``{flat: {key: shard or scalar}}`` for the entries ``want(flat,
    key)`` accepts, each shard checked and on ``devices[flat]`` (all on one GPU: through its ring, a piece at a time,
    into the tensors ``destination`` gives, new ones by default; else read into new host memory, as
    :meth:`ShardedCheckpoint.load_rank` reads). With new tensors nothing live is touched; a checksum mismatch raises
    ``ValueError`` naming the file, the elements and their unit."""
    ring, rank_file = _ring_and_file(ckpt, rank, devices)
    if ring is None or rank_file is None:
        return _kept(ckpt.load_rank(rank), want)
    try:
        pieces = plan_pieces(rank_file, ring.slot_bytes)
        out, into = _destinations(ckpt.manifest, rank_file, devices, want, destination)
        ring.copier.after(ring.copier.mark())  # the new tensors' memory may be the current stream's until now
        stream_pieces(ring, pieces, _stages(rank_file), partial(_copies, into))
    finally:
        rank_file.release()
    return out


def _kept(loaded: Mapping[int, Mapping[str, Any]], want: Callable[[int, str], bool]) -> dict[int, dict[str, Any]]:
    units = ((i, {k: v for k, v in entries.items() if want(i, k)}) for i, entries in loaded.items())
    return {i: entries for i, entries in units if entries}


def _destinations(
    manifest: Manifest,
    rank_file: RankFile,
    devices: Sequence[torch.device],
    want: Callable[[int, str], bool],
    destination: Destination,
) -> tuple[dict[int, dict[str, Any]], dict[tuple[int, str], torch.Tensor]]:
    """The entries a load returns (for the shards, the tensors on their devices ``destination`` gives; the
    manifest's scalars), and the tensors by ``(flat, key)`` that the pieces fill."""
    out: dict[int, dict[str, Any]] = {}
    into: dict[tuple[int, str], torch.Tensor] = {}
    for i, flat in enumerate(manifest.flat_params):
        for e in (e for e in flat.state if want(i, e.key)):
            if e.kind is not StateKind.SHARDED:
                out.setdefault(i, {})[e.key] = clone_value(e.value)  # the optimizer owns what it loads
                continue
            tensor, _, numel = rank_file.layout[0][(i, e.key)]
            dtype = dtype_from_str(tensor, where=str(rank_file.path))
            landing = destination(i, e.key, numel, dtype, devices[i])
            assert landing.is_contiguous() and landing.numel() == numel and landing.dtype == dtype, f"({i}, {e.key})"
            out.setdefault(i, {})[e.key] = into[(i, e.key)] = landing
    return out, into


def _copies(
    into: Mapping[tuple[int, str], torch.Tensor], piece: TensorPiece, slot: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination bytes, slot bytes)`` for each wanted shard's part in ``piece``, read into ``slot``."""
    size = piece.dtype.itemsize
    for shard, a, b in piece.spans():
        dst = into.get((shard.flat, shard.key))
        if dst is not None:
            at = (shard.offset + a - piece.lo) * size
            yield dst.view(torch.uint8)[a * size : b * size], slot[at : at + (b - a) * size]


def stream_pieces(ring: Ring, pieces: Sequence[TensorPiece], stages: Sequence[Stage], copies: Copies) -> None:
    """Each piece put through ``stages`` in a slot of ``ring``, each stage on a thread of its own (``stage(piece, slot
    bytes)``: the first reads the piece into the slot, the next checks it there), then copied out of the slot
    (``copies(piece, slot bytes)``: ``(dst, src)`` pairs, queued on ``ring``'s copier) while the stages work on the
    next slots. Returns once every copy is done; the first failure (a read, a check, a copy) is raised once every
    thread has stopped and every copy started is done, so the slots are free again."""
    assert stages, "a stream needs a stage that fills the slots"
    with ring.lock:
        free: _Queue = queue.Queue()
        for slot in range(len(ring.buffers)):
            free.put((slot, ()))
        stop = threading.Event()
        boxes: list[_Queue] = [queue.Queue() for _ in stages]  # boxes[k]: what stage k hands on
        threads = [threading.Thread(target=_fill_slots, args=(ring, pieces, stages[0], free, boxes[0], stop))]
        threads += [
            threading.Thread(target=_pass_on, args=(ring, stage, boxes[k], boxes[k + 1], stop))
            for k, stage in enumerate(stages[1:])
        ]
        for k, thread in enumerate(threads):
            thread.name, thread.daemon = f"fsdp_optim-load-{k}", True
            thread.start()
        started: list[list[Any]] = [[] for _ in ring.buffers]  # each slot's copies not yet awaited by the reader
        try:
            while (item := boxes[-1].get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                slot, piece = item
                started[slot] = [ring.copier.copy(d, s) for d, s in copies(piece, ring.buffers[slot][: piece.nbytes])]
                free.put((slot, tuple(started[slot])))
        finally:
            stop.set()
            free.put((-1, ()))  # wakes a reader waiting for a slot
            for thread in threads:
                thread.join()
            for ticket in (t for tickets in started for t in tickets):
                ring.copier.wait(ticket)  # (again, for those the reader awaited: done, so at once)


def _fill_slots(
    ring: Ring, pieces: Sequence[TensorPiece], stage: Stage, free: _Queue, out: _Queue, stop: threading.Event
) -> None:
    """The first stage's thread: a free slot (its copies awaited), the next piece read into it, handed on."""
    try:
        ring.copier.bind()  # waits on this GPU's events here open no context on another GPU
        for piece in pieces:
            slot, tickets = free.get()
            if stop.is_set() or slot < 0:
                return
            for ticket in tickets:
                ring.copier.wait(ticket)  # the copies out of this slot are done: refill it
            stage(piece, ring.buffers[slot][: piece.nbytes])
            out.put((slot, piece))
    except BaseException as exc:  # the caller raises it, once every thread has stopped
        out.put(exc)
    finally:
        out.put(None)  # (after a failure: never read)


def _pass_on(ring: Ring, stage: Stage, inbox: _Queue, out: _Queue, stop: threading.Event) -> None:
    """A later stage's thread: each slot handed in, worked on, handed on; a failure or the end, handed on."""
    try:
        while (item := inbox.get()) is not None and not isinstance(item, BaseException) and not stop.is_set():
            slot, piece = item
            stage(piece, ring.buffers[slot][: piece.nbytes])
            out.put(item)
        out.put(item if not isinstance(item, tuple) else None)
    except BaseException as exc:
        out.put(exc)


def into_live(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each checked tensor into its live tensor (``(live, checked)``): on the device, through the pinned ring or
    directly. A floating-point tensor of another dtype is cast first; any other difference of dtype or shape is
    refused before a byte is written."""
    ready = [(live, t.to(live.dtype) if _castable(t, live) else t) for live, t in pairs if not _same(live, t)]
    check_pairs(ready)  # all or nothing: the device-side pairs too, before the first of them is copied
    on_device = [(live, t) for live, t in ready if live.is_cuda and t.device == live.device]
    with torch.no_grad():
        for live, t in on_device:
            live.copy_(t)
    upload([(live, t) for live, t in ready if not (live.is_cuda and t.device == live.device)])


def _same(live: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` is ``live``'s own memory (a load read it there: nothing to copy)."""
    same_place = live.device == t.device and live.data_ptr() == t.data_ptr()
    return same_place and live.shape == t.shape and live.dtype == t.dtype


def live_destination(params: Sequence[torch.Tensor], optim: torch.optim.Optimizer | None) -> Destination:
    """Where a load at the saved layout reads each shard (:meth:`fsdp_optim.job.ring_load.Verified.land`): the live
    tensor itself (the parameter's data, the optimizer's own state tensor) when it fits (numel, dtype, device,
    contiguous); else a new tensor (an optimizer that has not stepped yet: it becomes its state)."""

    def destination(flat: int, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        param = params[flat]
        state = optim.state.get(param, {}) if optim is not None else {}
        live = param.data if key == WEIGHTS_KEY else state.get(key)
        if (torch.is_tensor(live) and live.numel() == numel and live.dtype == dtype and live.device == device
                and live.is_contiguous()):  # fmt: skip
            return live.detach().view(-1)
        return torch.empty(numel, dtype=dtype, device=device)

    return destination


def _castable(host: torch.Tensor, live: torch.Tensor) -> bool:
    return host.dtype != live.dtype and host.is_floating_point() and live.is_floating_point()


def optimizer_state_on_device(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (``{"state": {id: {key: tensor or value}}, "param_groups": [...]}``, as
    ``optim.load_state_dict`` takes it) with every state tensor where the module docstring's rule puts it, cast to
    the dtype ``load_state_dict`` would cast it to (``step`` as it is). A tensor already on its parameter's device
    becomes the state: a copy into the live tensor would lower no peak, since ``load_state_dict`` frees the live
    tensors. An async save still copying ``optim``'s state is waited for first (its pre-hook on ``load_state_dict``
    would come too late)."""
    before_change(optim)
    params = _params_by_id(optim, state_dict)
    state: dict[Any, dict[str, Any]] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for pid, entries in state_dict["state"].items():
        param = params[pid]
        live = optim.state.get(param, {})
        state[pid] = dict(entries)
        for key, value in entries.items():
            if key == "step" or not torch.is_tensor(value):
                continue
            dtype = param.dtype if param.is_floating_point() else value.dtype
            target = live.get(key)
            fits = _fits(target, value, dtype, param.device)
            if value.device == param.device:  # memory of its own where it belongs (or the live tensor's own)
                state[pid][key] = target if fits and _same(target, value) else value.to(dtype)
                continue
            if not fits:
                target = torch.empty(value.shape, dtype=dtype, device=param.device)
            pairs.append((target, value.to(dtype)))  # as load_state_dict casts it (an integer one too)
            state[pid][key] = target
    into_live(pairs)
    return {**state_dict, "state": state}


def _fits(target: Any, value: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    return (torch.is_tensor(target) and target.shape == value.shape and target.dtype == dtype
            and target.device == device and target.is_contiguous())  # fmt: skip


def _params_by_id(optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> dict[Any, torch.Tensor]:
    """``{saved param id: live parameter}``, matched as ``load_state_dict`` matches them."""
    return {
        pid: param
        for saved, group in zip(state_dict["param_groups"], optim.param_groups, strict=True)
        for pid, param in zip(saved["params"], group["params"], strict=True)
    }
