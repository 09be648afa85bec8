"""Device-to-host staging: how every save (sync, async, to an object store, into the memory tier) moves GPU memory.

Shards on a GPU reach the host through pinned memory that is allocated once per process and reused by every later
save, copied on a side CUDA stream, so that no save copies through pageable memory and none grows host memory:

- **synchronous writes** (:func:`pieces`): a ring of ``SLOTS`` pinned buffers of ``SLOT_BYTES``; the copy of the
  next slots runs while the writer hashes and writes the one at hand (:class:`Ring`);
- **loads into a GPU** (:func:`upload`): the same ring the other way: a slot is filled from the file's pages while
  the copies out of the earlier slots run, straight into the live parameters and optimizer state;
- **asynchronous saves** (:meth:`Staging.copy`): one reused host buffer per shard (pinned for shards on a GPU),
  the copies enqueued on the side stream by the save's thread; the optimizer's next ``step()`` makes its stream
  wait for them on the GPU (:meth:`Staged.before_change`), not the host.

Ordering: the side stream first waits for an event recorded on the caller's current stream when the save was
called (:func:`mark`), so the copies see every kernel queued before the call and none after; every source is
``record_stream``-ed on the side stream, so the caching allocator does not hand its memory to another tensor before
the copy has read it. No GPU memory is allocated. Tensors already on the CPU are never copied by the ring: the
writer reads them where they are (:func:`fsdp_optim.formats.sharded.rank_file.host_pieces`).

The ring's logic takes a :class:`Copier`; :class:`HostCopier` runs it with synchronous host copies, which is how the
tests check its order and its reuse of memory on machines without a GPU (``tests/test_stager.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fsdp_optim.formats.sharded.rank_file import host_pieces

__all__ = [
    "SLOTS",
    "SLOT_BYTES",
    "Copier",
    "CudaCopier",
    "HostCopier",
    "Ring",
    "Staged",
    "Staging",
    "before_change",
    "expect",
    "mark",
    "pieces",
    "pinned",
    "upload",
    "ready_events",
]

SLOTS = 4  # copies in flight while one slot is hashed and written
SLOT_BYTES = 32 << 20  # 128 MiB of pinned memory per GPU for the ring: large copies, little memory


class Copier(Protocol):
    """Where a ring's buffers live and how a copy into one is made and awaited."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host ``uint8`` buffer of ``nbytes`` (pinned, for copies from a GPU)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying ``src`` into ``dst`` (same number of bytes); a ticket for :meth:`wait`."""
        ...

    def wait(self, ticket: Any) -> None:
        """Block the host until the copy of ``ticket`` is done."""
        ...


class HostCopier:
    """Synchronous copies into ordinary host memory: the ring's logic without a GPU."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def wait(self, ticket: Any) -> None:  # noqa: ARG002 - the copy was synchronous
        return None


class CudaCopier:
    """Copies from one GPU on a side stream of its own into pinned host memory, each awaited through its event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def after(self, event: Any) -> None:
        """Make the side stream wait (on the GPU) for ``event``, recorded on the caller's stream."""
        self.stream.wait_event(event)

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            if src.is_cuda:  # the allocator keeps src's memory until the side stream has read it
                src.record_stream(self.stream)
            done = torch.cuda.Event(blocking=True)  # a waiting host thread sleeps instead of spinning on a core
            done.record(self.stream)
        return done

    def wait(self, ticket: Any) -> None:
        ticket.synchronize()


class Ring:
    """``slots`` reused host buffers of ``slot_bytes``: the bytes of many tensors streamed through them in order,
    the copies of the next slots in flight while the caller uses the current one."""

    def __init__(self, copier: Copier, *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        assert slots >= 1 and slot_bytes >= 1, f"expected a slot or more of a byte or more, found {slots}, {slot_bytes}"
        self.copier = copier
        self.slot_bytes = slot_bytes
        self.buffers = [copier.buffer(slot_bytes) for _ in range(slots)]
        self.lock = threading.Lock()  # one stream of pieces at a time

    def pieces(self, parts: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        """The bytes of the 1-D ``parts`` in order, as views of the ring's buffers; each valid until the next is
        asked for. A generator closed early still waits for the copies it started (the buffers are reused)."""
        with self.lock:
            spans = _spans(parts, self.slot_bytes)
            flight: deque[tuple[int, int, Any]] = deque()  # (slot, bytes, ticket) in order of the spans
            try:
                for slot in range(len(self.buffers)):
                    if not self._issue(spans, slot, flight):
                        break
                while flight:
                    slot, nbytes, ticket = flight.popleft()
                    self.copier.wait(ticket)
                    yield self.buffers[slot][:nbytes]
                    self._issue(spans, slot, flight)  # the caller is done with this slot
            finally:
                for _, _, ticket in flight:
                    self.copier.wait(ticket)

    def upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each host tensor ``src`` into its ``dst`` (same number of bytes, ``dst`` contiguous) through the ring:
        a slot is filled from ``src`` (the read, e.g. of a mapped file's pages) while the copies out of the earlier
        slots run. Returns once every copy is done (one slot's copy after the last read)."""
        with self.lock:
            busy: list[Any] = [None] * len(self.buffers)
            slot, last = 0, None
            try:
                for dst, src in pairs:
                    out = dst.detach().reshape(-1).view(torch.uint8)
                    if out.numel() != src.numel() * src.element_size() or not dst.is_contiguous():
                        raise ValueError(
                            f"cannot copy {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}"
                        )
                    for at, span in _offsets(src, self.slot_bytes):
                        if busy[slot] is not None:
                            self.copier.wait(busy[slot])  # the copy out of this slot is done: refill it
                        n = span.numel()
                        self.buffers[slot][:n].copy_(span)
                        last = busy[slot] = self.copier.copy(out[at : at + n], self.buffers[slot][:n])
                        slot = (slot + 1) % len(self.buffers)
            finally:
                if last is not None:
                    self.copier.wait(last)  # copies run in order: the last done, every slot is free

    def _issue(self, spans: Iterator[torch.Tensor], slot: int, flight: deque[tuple[int, int, Any]]) -> bool:
        span = next(spans, None)
        if span is None:
            return False
        n = span.numel()
        flight.append((slot, n, self.copier.copy(self.buffers[slot][:n], span)))
        return True


def _offsets(part: torch.Tensor, size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(byte offset, uint8 view of at most size bytes)`` over one tensor's bytes."""
    raw = part.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, raw.numel(), size):
        yield start, raw[start : start + size]


def _spans(parts: Sequence[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """The bytes of ``parts`` as ``uint8`` views of at most ``size`` bytes (no copy of a contiguous part)."""
    for part in parts:
        raw = part.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), size):
            yield raw[start : start + size]


_copiers: dict[int, CudaCopier] = {}  # one side stream per GPU, for the process's life
_rings: dict[int, Ring] = {}  # one per GPU, for the process's life: the pinned memory every later save reuses
_rings_lock = threading.Lock()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _copier(device: torch.device) -> CudaCopier:
    index = _index(device)
    with _rings_lock:
        if index not in _copiers:
            _copiers[index] = CudaCopier(torch.device("cuda", index))
        return _copiers[index]


def _ring(device: torch.device) -> Ring:
    copier = _copier(device)  # before the lock: it takes it too
    with _rings_lock:
        index = _index(device)
        if index not in _rings:
            _rings[index] = Ring(copier)
        return _rings[index]


def pieces(parts: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The writer's :data:`~fsdp_optim.formats.sharded.rank_file.Pieces` for a job: host tensors as they are,
    shards on a GPU through that GPU's pinned ring, the copies ordered after what the caller's stream queued."""
    device = next((p.device for p in parts if p.device.type != "cpu"), None)
    if device is None:
        return host_pieces(parts)
    if device.type != "cuda":
        raise ValueError(f"a shard on {device}: the stager copies from CPU and CUDA memory only")
    # Made contiguous now, before the mark: a copy kernel queued after it would race the side stream's reads.
    parts = [p.detach().reshape(-1).contiguous() for p in parts]
    ring = _ring(device)
    assert isinstance(ring.copier, CudaCopier), "a GPU's ring copies from that GPU"
    ring.copier.after(mark(device))
    return ring.pieces(parts)


def upload(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy host tensors into live tensors (``(dst, src)`` pairs): into GPU tensors through that GPU's pinned ring,
    ordered after what the caller's stream queued (a kernel still using ``dst`` finishes first); into host tensors
    directly. Returns once every byte is in place."""
    on_gpu = [(d, s) for d, s in pairs if d.is_cuda]
    with torch.no_grad():
        for dst, src in pairs:
            if not dst.is_cuda:
                dst.copy_(src)
    if on_gpu:
        device = on_gpu[0][0].device
        if any(d.device != device for d, _ in on_gpu):
            raise ValueError(f"live tensors on several GPUs: {sorted({str(d.device) for d, _ in on_gpu})}")
        ring = _ring(device)
        assert isinstance(ring.copier, CudaCopier), "a GPU's ring copies to that GPU"
        ring.copier.after(mark(device))
        ring.upload(on_gpu)


def mark(device: torch.device) -> Any:
    """An event recorded now on ``device``'s current stream: copies made after it see everything queued before."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass
class Staged:
    """One async save's copy into host memory: ``issued`` once every copy is done (host tensors) or enqueued
    (GPU tensors, each GPU's last copy recorded in ``done``), ``staged`` once the host holds every byte."""

    issued: threading.Event = field(default_factory=threading.Event)
    staged: threading.Event = field(default_factory=threading.Event)
    done: list[tuple[torch.device, Any]] = field(default_factory=list)  # per GPU: an event after its last copy

    def before_change(self) -> None:
        """Before the live state changes (``optim.step()``, ``load_state_dict()``, a load): the host waits until the
        copies are enqueued; the caller's stream then waits, on the GPU, until they are done."""
        self.issued.wait()
        for device, event in self.done:
            torch.cuda.current_stream(device).wait_event(event)

    def finish(self) -> None:
        """Never left unset: a step waiting for a failed save must not hang."""
        self.issued.set()
        self.staged.set()


_pending: weakref.WeakKeyDictionary[torch.optim.Optimizer, Staged] = weakref.WeakKeyDictionary()


def expect(optim: torch.optim.Optimizer, staged: Staged) -> None:
    """Record that ``optim``'s state (and its model's weights) are being copied by ``staged``."""
    _pending[optim] = staged


def before_change(optim: torch.optim.Optimizer | None) -> None:
    """What anything that changes ``optim``'s state or its model's weights calls first: the last async save's copy
    of them is enqueued (host) and done before the caller's stream goes on (GPU). Nothing when none is pending."""
    staged = _pending.get(optim) if optim is not None else None
    if staged is not None:
        staged.before_change()


_ALIGN = 512  # bytes: every staged tensor starts aligned in the arena


class Staging:
    """Host memory for one root's shards, kept across saves: a plain buffer per host tensor, ``(flat, key)`` -> a
    tensor of that shape and dtype, and one pinned arena for the shards on GPUs (registered with CUDA at its exact
    size: the caching host allocator would round each block up to a power of two, up to twice the state)."""

    def __init__(self) -> None:
        self.host: dict[tuple[int, str], torch.Tensor] = {}
        self.arena: torch.Tensor | None = None
        self.layout: tuple[tuple[tuple[int, str], torch.Size, torch.dtype], ...] = ()
        self.views: dict[tuple[int, str], torch.Tensor] = {}

    def copy(self, state: Mapping[int, Mapping[str, Any]], ready: Mapping[torch.device, Any], staged: Staged) -> Any:
        """``state`` (``{flat: {key: live tensor or value}}``) copied into this root's memory: host tensors at once,
        GPU tensors enqueued after ``ready[device]`` (:func:`mark`, taken when the save was called); sets
        ``staged.issued``, waits for the GPU copies, sets ``staged.staged``. Returns the copy, same shape."""
        on_gpu = [((i, k), v.detach()) for i, e in state.items() for k, v in e.items() if _is_gpu(v)]
        self._fit([(key, v.shape, v.dtype) for key, v in on_gpu])
        out: dict[int, dict[str, Any]] = {i: {} for i in state}
        copiers: dict[torch.device, CudaCopier] = {}
        try:
            for (i, key), value in on_gpu:
                if value.device not in copiers:
                    copiers[value.device] = _copier(value.device)
                    copiers[value.device].after(ready[value.device])
                out[i][key] = self.views[(i, key)]
                copiers[value.device].copy(out[i][key], value)
            for i, entries in state.items():
                for key, value in entries.items():
                    if not _is_gpu(value):
                        out[i][key] = self._host_copy(i, key, value)
        finally:  # every copy enqueued is waited for, even when a later one failed
            staged.done = [(device, _last(copier)) for device, copier in copiers.items()]
            staged.issued.set()
        for _, event in staged.done:
            event.synchronize()
        staged.staged.set()
        return {i: {k: out[i][k] for k in state[i]} for i in state}  # the state's own order

    @property
    def buffers(self) -> int:
        """How many tensors this root's staging holds memory for (host buffers and arena views)."""
        return len(self.host) + len(self.views)

    def _fit(self, specs: list[tuple[tuple[int, str], torch.Size, torch.dtype]]) -> None:
        """The arena and its views for these shards: kept when the shapes and dtypes are those of the last save."""
        layout = tuple(specs)
        if layout == self.layout:
            return
        offsets, total = [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            total += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.arena, self.layout, self.views = None, (), {}  # the old arena is released (and unregistered) first
        arena = pinned(total) if total else None
        views = {}
        for (key, shape, dtype), at in zip(layout, offsets, strict=True):
            assert arena is not None, "a shard to stage has an arena"
            views[key] = arena[at : at + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        self.arena, self.layout, self.views = arena, layout, views

    def _host_copy(self, i: int, key: str, value: Any) -> Any:
        if not torch.is_tensor(value):
            return value
        value = value.detach()
        buffer = self.host.get((i, key))
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype)
            self.host[(i, key)] = buffer
        buffer.copy_(value)
        return buffer


def _is_gpu(value: Any) -> bool:
    return torch.is_tensor(value) and value.device.type == "cuda"


def pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory registered with CUDA (page-locked) at exactly that size, unregistered when the
    returned tensor is dropped (views cut from it may outlive it: host reads need no registration, and its owner
    copies into it only while it holds it)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    pointer = buffer.data_ptr()
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
    if code != 0:
        raise RuntimeError(f"cannot page-lock {nbytes} bytes of host memory for staging (CUDA error {code})")
    weakref.finalize(buffer, _unregister, pointer)  # the arena tensor: its owner drops it only between saves
    return buffer


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def _last(copier: CudaCopier) -> Any:
    event = torch.cuda.Event(blocking=True)
    event.record(copier.stream)
    return event


def ready_events(state: Mapping[int, Mapping[str, Any]]) -> dict[torch.device, Any]:
    """:func:`mark` on every GPU that holds a tensor of ``state``: taken in the caller's thread when a save is
    called (the copies, made later by the save's thread, must see the state as it was then)."""
    devices = {v.device for entries in state.values() for v in entries.values() if torch.is_tensor(v)}
    return {d: mark(d) for d in devices if d.type == "cuda"}
