"""Device-to-host staging: how every save (sync, async, to an object store, into the memory tier) moves GPU memory.

Shards on a GPU reach the host through pinned memory that is allocated once per process and reused by every later
save, copied on a side CUDA stream, so that no save copies through pageable memory and none grows host memory:

- **synchronous writes** (:func:`pieces`): a ring of ``SLOTS`` pinned buffers of ``SLOT_BYTES``; the copy of the
  next slots runs while the writer hashes and writes the one at hand (:class:`Ring`);
- **loads into a GPU** (:func:`upload`): the same ring the other way: a slot is filled from the file's pages while
  the copies out of the earlier slots run, straight into the live parameters and optimizer state;
- **asynchronous saves** (:meth:`fsdp_optim.job.staging.HostStaging.copy`): one reused page-locked arena for the shards
  on GPUs (a layout's first save fills it through the ring), the copies enqueued on the side stream by the save's
  thread; the optimizer's next ``step()`` makes its stream wait for them on the GPU
  (:meth:`fsdp_optim.job.staging.StagedCopy.before_change`), not the host.

Ordering: the side stream first waits for an event recorded on the caller's current stream when the save was
called (:func:`mark`), so the copies see every kernel queued before the call and none after; every source is
``record_stream``-ed on the side stream, so the caching allocator does not hand its memory to another tensor before
the copy has read it. No GPU memory is allocated. Tensors already on the CPU are never copied by the ring: the
writer reads them where they are (:func:`fsdp_optim.formats.sharded.rank_file.host_pieces`).

Every copy goes through one seam: a :class:`~fsdp_optim.job.copiers.Copier` (one device's copy engine: queue a
copy, wait for its ticket, make later copies wait for a mark, make the caller's stream wait for a ticket), chosen per
tensor by an :class:`Engines` (:data:`CUDA` in a job). :class:`~fsdp_optim.job.copiers.HostCopier` copies
synchronously on the host; the tests run the ring, an async save's arena and the staging order under a copier whose
copies land later on a thread of their own (``tests/_async_copier.py``), so an ordering mistake gives wrong bytes on a
machine without a GPU too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from fsdp_optim.formats.sharded.rank_file import host_pieces
from fsdp_optim.job.copiers import Copier, CudaCopier

__all__ = [
    "SLOTS",
    "SLOT_BYTES",
    "CUDA",
    "CudaEngines",
    "Engines",
    "Ring",
    "check_pairs",
    "copier_of",
    "ring_of",
    "pieces",
    "upload",
]

SLOTS = 4  # copies in flight while one slot is hashed and written
SLOT_BYTES = 32 << 20  # 128 MiB of pinned memory per GPU for the ring: large copies, little memory


class Engines(Protocol):
    """Which copy engine a tensor sits behind (``None``: host memory, read where it is), and each engine's ring.
    :data:`CUDA` in a job; the tests pass an engine of their own that models a GPU's on the CPU."""

    def of(self, tensor: torch.Tensor) -> Copier | None:
        """The copier of the device holding ``tensor``, ``None`` for host memory; refuses another device."""
        ...

    def ring(self, copier: Copier) -> Ring:
        """That copier's ring, made once and reused by every later save and load."""
        ...


class Ring:
    """``slots`` reused host buffers of ``slot_bytes``: the bytes of many tensors streamed through them in order,
    the copies of the next slots in flight while the caller uses the current one."""

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
        """Copy each host tensor ``src`` into its ``dst`` (same shape and dtype, ``dst`` contiguous, on the copier's
        device: every pair checked before the first byte is written) through the ring: a slot is filled from ``src``
        (the read, e.g. of a mapped file's pages) while the copies out of the earlier slots run. Returns once every
        copy is done (one slot's copy after the last read)."""
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
    """``(byte offset, uint8 view of at most size bytes)`` over one tensor's bytes."""
    raw = part.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, raw.numel(), size):
        yield start, raw[start : start + size]


def _spans(parts: Sequence[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """The bytes of ``parts`` as ``uint8`` views of at most ``size`` bytes (no copy of a contiguous part)."""
    for part in parts:
        for _, span in _offsets(part, size):
            yield span


class CudaEngines:
    """The GPUs' copy engines: one side stream (:class:`~fsdp_optim.job.copiers.CudaCopier`) and one ring per GPU,
    for the process's life (the ring's pinned memory is what every later save and load reuses)."""

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


def copier_of(device: torch.device) -> CudaCopier:
    """The side stream's copier of GPU ``device`` (one per GPU, for the process's life)."""
    return CUDA.copier(device)


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


def ring_of(device: torch.device) -> Ring:
    """The pinned ring of the GPU ``device`` (one per GPU, for the process's life), for a caller that streams through
    its slots itself (a load reading a file straight into them: :mod:`fsdp_optim.job.ring_load`)."""
    return CUDA.ring(copier_of(device))
