"""Device-to-host staging: how every save (sync, async, to an object store, into the memory tier) moves GPU memory.

Shards on a GPU reach the host through pinned memory allocated once per process and reused by every later save,
copied on a side CUDA stream, so that no save copies through pageable memory and none grows host memory:

- **synchronous writes** (:func:`pieces`): a ring of ``SLOTS`` pinned buffers of ``SLOT_BYTES``; the copy of the
  next slots runs while the writer hashes and writes the one at hand (:class:`Ring`);
- **loads into a GPU** (:func:`upload`): the same ring the other way, straight into the live tensors;
- **asynchronous saves**: :mod:`fsdp_optim.job.staging` (a reused page-locked arena; ``step()`` waits on the GPU).

Ordering: the side stream first waits for an event recorded on the caller's current stream when the save was
called (:meth:`Copier.mark`), so the copies see every kernel queued before the call and none after; every source is
``record_stream``-ed on the side stream, so the caching allocator does not reuse its memory before the copy has read
it. No GPU memory is allocated. Host tensors are never copied by the ring: the writer reads them where they are.

Every copy goes through one seam, a :class:`Copier` (one device's copy engine), chosen per tensor by an
:class:`Engines` (:data:`CUDA` in a job). :class:`HostCopier` copies synchronously on the host; the tests run the
ring, the arena and the staging order under a copier whose copies land later on a thread of their own
(``tests/_async_copier.py``), so an ordering mistake gives wrong bytes on a machine without a GPU too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Protocol, cast

import torch

from fsdp_optim.formats.sharded.rank_file import host_pieces

__all__ = [
    "CUDA", "DONE", "SLOTS", "SLOT_BYTES", "Copier", "CudaCopier", "CudaEngines", "Engines", "HostCopier", "Ring",
    "Ticket", "check_pairs", "pieces", "upload",
]  # fmt: skip

SLOTS = 4  # copies in flight while one slot is hashed and written
SLOT_BYTES = 32 << 20  # 128 MiB of pinned memory per GPU for the ring: large copies, little memory


class Ticket(Protocol):
    """A copy's or a mark's answer (a CUDA event, or one done from the start on the host)."""

    def synchronize(self) -> None:
        """Block the host until it is done."""
        ...


class Copier(Protocol):
    """One device's copy engine, as the host sees it: copies queued in order on a stream of their own, each answered
    by a :class:`Ticket`."""

    device: torch.device  # where the copies' device-side tensors live

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host ``uint8`` buffer of ``nbytes`` (pinned, for copies from a GPU)."""
        ...

    def mark(self) -> Ticket:
        """An event recorded now on the caller's current stream of this device."""
        ...

    def after(self, event: Ticket) -> None:
        """Copies queued from now on start once ``event`` (a :meth:`mark`) is done."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Queue a copy of ``src`` into ``dst`` (same number of bytes); a ticket for :meth:`wait`."""
        ...

    def wait(self, ticket: Ticket) -> None:
        """Block the host until the copy of ``ticket`` is done."""
        ...

    def last(self) -> Ticket:
        """A ticket done once every copy queued so far is done (copies run in order)."""
        ...

    def hold(self, ticket: Ticket) -> None:
        """Make whatever the caller queues next on this device wait for ``ticket`` (on a GPU: its stream waits,
        not the host)."""
        ...

    def bind(self) -> None:
        """Make this copier's device the calling thread's current device (a thread of its own starts on GPU 0)."""
        ...


class _Done:
    """A ticket that is done from the start: what a synchronous copy answers."""

    def synchronize(self) -> None:
        return None


DONE = _Done()


class HostCopier:
    """Synchronous copies into ordinary host memory: the ring's logic without a GPU (every ticket done at once)."""

    device = torch.device("cpu")

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def mark(self) -> Ticket:
        return DONE

    def after(self, event: Ticket) -> None:  # noqa: ARG002 - the host ran everything queued before
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        dst.copy_(src)
        return DONE

    def wait(self, ticket: Ticket) -> None:
        ticket.synchronize()

    def last(self) -> Ticket:
        return DONE

    def hold(self, ticket: Ticket) -> None:
        ticket.synchronize()

    def bind(self) -> None:
        return None


class CudaCopier:
    """Copies from one GPU on a side stream of its own into pinned host memory, each awaited through its event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __str__(self) -> str:
        return str(self.device)

    def buffer(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def mark(self) -> Ticket:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def after(self, event: Ticket) -> None:
        self.stream.wait_event(cast(torch.cuda.Event, event))  # one of this GPU's own marks

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            if src.is_cuda:  # the allocator keeps src's memory until the side stream has read it
                src.record_stream(self.stream)
            done = torch.cuda.Event(blocking=True)  # a waiting host thread sleeps instead of spinning on a core
            done.record(self.stream)
        return done

    def wait(self, ticket: Ticket) -> None:
        ticket.synchronize()

    def last(self) -> Ticket:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        return event

    def hold(self, ticket: Ticket) -> None:
        torch.cuda.current_stream(self.device).wait_event(cast(torch.cuda.Event, ticket))  # one of its own copies'

    def bind(self) -> None:
        torch.cuda.set_device(self.device)


class Engines(Protocol):
    """Which copy engine a tensor sits behind (``None``: host memory), and each engine's ring."""

    def of(self, tensor: torch.Tensor) -> Copier | None:
        """The copier of the device holding ``tensor``, ``None`` for host memory; refuses another device."""
        ...

    def ring(self, copier: Copier) -> Ring:
        """That copier's ring, made once."""
        ...


class Ring:
    """``slots`` reused host buffers of ``slot_bytes``, the copies of the next slots in flight while the caller uses
    the current one."""

    def __init__(self, copier: Copier, *, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        assert slots >= 1 and slot_bytes >= 1, f"expected a slot or more of a byte or more, found {slots}, {slot_bytes}"
        self.copier = copier
        self.slot_bytes = slot_bytes
        self.buffers = [copier.buffer(slot_bytes) for _ in range(slots)]
        self.lock = threading.Lock()  # one stream of pieces at a time

    def pieces(self, parts: Sequence[torch.Tensor]) -> Generator[torch.Tensor, None, None]:
        """The bytes of the 1-D ``parts`` in order, as views of the ring's buffers; each valid until the next is
        asked for. A generator closed early still waits for the copies it started (the buffers are reused)."""
        with self.lock:
            spans = (span for part in parts for _, span in _offsets(part, self.slot_bytes))
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
        """Copy each host tensor ``src`` into its ``dst`` (checked: :func:`check_pairs`) through the ring: a slot is
        filled from ``src`` while the copies out of the earlier slots run. Returns once every copy is done."""
        check_pairs(pairs, self.copier.device)
        with self.lock:
            busy: list[Any] = [None] * len(self.buffers)
            slot, last = 0, None
            try:
                for dst, src in pairs:
                    out = dst.detach().reshape(-1).view(torch.uint8)
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


def check_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device | None = None) -> None:
    """Refuse, before anything is copied, a ``(live, source)`` pair whose shapes or dtypes differ (a copy of the same
    number of bytes would reinterpret them) and, with ``device`` (a ring's), a live tensor that is not a contiguous
    tensor on it. Every problem is named in one ``ValueError``."""
    errors = []
    for i, (dst, src) in enumerate(pairs):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            errors.append(
                f"live tensor {i}: expected {tuple(dst.shape)} {dst.dtype} (the live tensor's shape and dtype), "
                f"found {tuple(src.shape)} {src.dtype} to copy into it"
            )
        elif device is not None and (dst.device != device or not dst.is_contiguous()):
            errors.append(f"live tensor {i}: expected a contiguous destination on {device}, found "
                          f"{'a strided one' if dst.device == device else 'one'} on {dst.device}")  # fmt: skip
    if errors:
        raise ValueError("cannot copy into the live tensors: " + "; ".join(errors))


def _offsets(part: torch.Tensor, size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(byte offset, uint8 view of at most size bytes)`` over one tensor's bytes (no copy of a contiguous one)."""
    raw = part.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, raw.numel(), size):
        yield start, raw[start : start + size]


class CudaEngines:
    """The GPUs' copy engines: one side stream (:class:`CudaCopier`) and one ring per GPU, for the process's life."""

    def __init__(self) -> None:
        self._copiers: dict[int, CudaCopier] = {}
        self._rings: dict[int, Ring] = {}
        self._lock = threading.Lock()

    def of(self, tensor: torch.Tensor) -> Copier | None:
        device = tensor.device
        if device.type == "cpu":
            return None
        if device.type != "cuda":
            raise ValueError(f"a tensor on {device}: the stager copies from and to CPU and CUDA memory only")
        return self.copier(device)

    def copier(self, device: torch.device) -> CudaCopier:
        """The side stream's copier of GPU ``device``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._copiers:
                self._copiers[index] = CudaCopier(torch.device("cuda", index))
            return self._copiers[index]

    def ring(self, copier: Copier) -> Ring:
        index = copier.device.index
        assert isinstance(copier, CudaCopier) and index is not None, f"a GPU's ring copies from it, not {copier}"
        with self._lock:
            if index not in self._rings:
                self._rings[index] = Ring(copier)
            return self._rings[index]


CUDA = CudaEngines()


def pieces(parts: Sequence[torch.Tensor], *, engines: Engines = CUDA) -> Iterator[torch.Tensor]:
    """The writer's :data:`~fsdp_optim.formats.sharded.rank_file.Pieces` for a job: host tensors as they are,
    shards on a GPU through that GPU's pinned ring, the copies ordered after what the caller's stream queued."""
    copiers = _distinct(engines.of(p) for p in parts)
    if not copiers:
        return host_pieces(parts)
    if len(copiers) > 1:  # one ring, one side stream, one ticket per slot: the copies of one device only
        raise ValueError(f"parts on several devices ({', '.join(map(str, copiers))}): a rank's shards are on one")
    (copier,) = copiers
    # Made contiguous now, before the mark: a copy kernel queued after it would race the side stream's reads.
    parts = [p.detach().reshape(-1).contiguous() for p in parts]
    ring = engines.ring(copier)
    copier.after(copier.mark())
    return ring.pieces(parts)


def upload(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, engines: Engines = CUDA) -> None:
    """Copy host tensors into live tensors (``(dst, src)`` pairs): into GPU tensors through that GPU's pinned ring,
    ordered after what the caller's stream queued (a kernel still using ``dst`` finishes first); into host tensors
    directly. Returns once every byte is in place."""
    check_pairs(pairs)  # all or nothing: every pair checked before the first byte is written
    routed = [(engines.of(d), d, s) for d, s in pairs]
    copiers = _distinct(c for c, _, _ in routed)
    if len(copiers) > 1:
        raise ValueError(f"live tensors on several devices ({', '.join(map(str, copiers))}): a rank's are on one")
    with torch.no_grad():
        for copier, dst, src in routed:  # host and strided device tensors: copied directly (ordered on the stream)
            if copier is None or not dst.is_contiguous():
                dst.copy_(src)
    through = [(d, s) for c, d, s in routed if c is not None and d.is_contiguous()]
    if through:
        ring = engines.ring(copiers[0])
        copiers[0].after(copiers[0].mark())
        ring.upload(through)


def _distinct(copiers: Iterable[Copier | None]) -> list[Copier]:
    """The copiers named, each once, in order (``None``: host memory, left out)."""
    found: list[Copier] = []
    for copier in copiers:
        if copier is not None and all(copier is not c for c in found):
            found.append(copier)
    return found
