"""Device-to-host staging: how every save (sync, async, to an object store, into the memory tier) moves GPU memory.

Shards on a GPU reach the host through pinned memory that is allocated once per process and reused by every later
save, copied on a side CUDA stream, so that no save copies through pageable memory and none grows host memory:

- **synchronous writes** (:func:`pieces`): a ring of ``SLOTS`` pinned buffers of ``SLOT_BYTES``; the copy of the
  next slots runs while the writer hashes and writes the one at hand (:class:`Ring`);
- **loads into a GPU** (:func:`upload`): the same ring the other way: a slot is filled from the file's pages while
  the copies out of the earlier slots run, straight into the live parameters and optimizer state;
- **asynchronous saves** (:meth:`fsdp_optim.job.staging.Staging.copy`): one reused page-locked arena for the shards
  on GPUs, the copies enqueued on the side stream by the save's thread; the optimizer's next ``step()`` makes its stream
  wait for them on the GPU (:meth:`fsdp_optim.job.staging.Staged.before_change`), not the host.

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
from collections import deque
from collections.abc import Iterator, Sequence
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
    "copier_of",
    "mark",
    "ring_of",
    "pieces",
    "upload",
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
        for _, span in _offsets(part, size):
            yield span


_copiers: dict[int, CudaCopier] = {}  # one side stream per GPU, for the process's life
_rings: dict[int, Ring] = {}  # one per GPU, for the process's life: the pinned memory every later save reuses
_rings_lock = threading.Lock()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def copier_of(device: torch.device) -> CudaCopier:
    """The side stream's copier of ``device`` (one per GPU, for the process's life)."""
    index = _index(device)
    with _rings_lock:
        if index not in _copiers:
            _copiers[index] = CudaCopier(torch.device("cuda", index))
        return _copiers[index]


def _ring(device: torch.device) -> Ring:
    copier = copier_of(device)  # before the lock: it takes it too
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


def ring_of(device: torch.device) -> Ring:
    """The pinned ring of the GPU ``device`` (one per GPU, for the process's life), for a caller that streams through
    its slots itself (a load reading a file straight into them: :mod:`fsdp_optim.job.ring_load`)."""
    return _ring(device)
