"""Async saves' staging: a root's reused host memory for its shards, copied on the stager's side stream
(:mod:`fsdp_optim.job.stager`), and the wait that whatever changes the state next goes through (:func:`before_change`).

One :class:`Arena` per root for its shards on GPUs, a plain buffer per host tensor, and the buffers and ``extra``'s
tensors copied at the call (:meth:`HostStaging.side_copy`). The copies are enqueued by the save's thread, bound to
the shards' GPU, after an event taken in the caller's thread when the save was called (:func:`ready_events`), so
they see the state at the call; ``optim.step()``, ``load_state_dict()`` and the loads wait for them on the GPU (the
host waits only until they are enqueued). Every copy queued has landed before :meth:`HostStaging.copy` returns or
raises.

The arena: one allocation at the exact size of the shards (the caching host allocator would round each block up to
a power of two, up to twice the state), kept across saves and by a layout change that fits, page-locked a chunk at a
time after a layout's first save. After the fact because ``cudaHostRegister`` of a 6 GiB arena takes seconds and no
copy can be queued into memory not yet page-locked: the first save of a layout copies through the GPU's ring, whose
slots are page-locked already, and the save's thread locks the arena once its upload is done
(:meth:`HostStaging.lock`), so ``optim.step()`` never waits for a registration. A copy never spans two
registrations (it is cut at :data:`CHUNK_BYTES` boundaries): the driver treats such memory as pageable.
Registration runs under the arena's GPU's context (:class:`CudaHost`): the save's thread would otherwise open a
context on GPU 0 on every rank. When it fails (no support, a locked-memory limit), the save goes on with a one-time
warning, and later arenas are ordinary pinned memory, or pageable where that fails too. The :class:`Registrar` is a
seam: the tests page-lock nothing, or fail (``tests/_async_copier.py``).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fsdp_optim.job.stager import CUDA, Copier, Engines, Ring

__all__ = [
    "CHUNK_BYTES", "CUDA_HOST", "Arena", "CudaHost", "HostStaging", "Registrar", "StagedCopy", "before_change",
    "expect", "ready_events",
]  # fmt: skip

CHUNK_BYTES = 256 << 20  # page-locked at a time: a copy of 256 MiB runs while the next chunk is locked


class Registrar(Protocol):
    """How host memory is page-locked for a device's copies (CUDA: ``cudaHostRegister``)."""

    def register(self, memory: torch.Tensor, device: torch.device) -> None:
        """Page-lock ``memory``'s bytes for copies with ``device``; raises when it cannot."""
        ...

    def unregister(self, pointer: int, device: torch.device) -> None:
        """Undo :meth:`register` of the memory starting at ``pointer``."""
        ...

    def clear_error(self, device: torch.device) -> None:
        """Forget the error a failed :meth:`register` left on this thread (CUDA keeps it as the runtime's last
        error, and the thread's next kernel launch would report it as its own)."""
        ...


class CudaHost:
    """``cudaHostRegister`` / ``cudaHostUnregister``, each under its GPU's context."""

    def register(self, memory: torch.Tensor, device: torch.device) -> None:
        nbytes = memory.numel() * memory.element_size()
        with torch.cuda.device(device):
            code = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, 0))
        if code != 0:
            raise RuntimeError(f"cannot page-lock {nbytes} bytes of host memory for staging (CUDA error {code})")

    def unregister(self, pointer: int, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(pointer)

    def clear_error(self, device: torch.device) -> None:
        """``cudaGetLastError`` of the CUDA runtime torch loaded (torch's bindings lack it): reads and resets it."""
        runtime = _loaded_cudart()
        if runtime is not None:
            with torch.cuda.device(device):
                runtime.cudaGetLastError()


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process already holds (the one torch calls), or None when none is found: a
    library loaded a second time would keep an error state of its own."""
    try:
        with open("/proc/self/maps") as maps:
            found = sorted({line.split()[-1] for line in maps if "/libcudart" in line})
    except OSError:
        return None
    return ctypes.CDLL(found[0]) if found else None


CUDA_HOST = CudaHost()


class Arena:
    """``nbytes`` of host memory for copies with ``device``, page-locked by ``registrar`` chunk by chunk
    (``None``: it needs no registration); unregistered when its ``memory`` is dropped (views cut from it may outlive
    it: host reads need no registration)."""

    def __init__(self, memory: torch.Tensor, device: torch.device, registrar: Registrar | None) -> None:
        self.memory = memory
        self.nbytes = memory.numel()
        self.device = device
        self.registrar = registrar
        self.locked = 0 if registrar is not None else self.nbytes  # bytes [0, locked) page-locked or needing none
        self.failed = False  # a registration failed: the rest is pageable
        self._pointers: list[int] = []
        if registrar is not None:
            weakref.finalize(memory, _unregister_all, registrar, self._pointers, device)

    @classmethod
    def allocate(cls, nbytes: int, device: torch.device, registrar: Registrar | None) -> Arena:
        """A new arena, nothing locked yet; with ``registrar=None`` (a registration failed before), the fallback
        memory."""
        if registrar is not None:
            return cls(torch.empty(nbytes, dtype=torch.uint8), device, registrar)
        return cls(_fallback(nbytes, device), device, None)

    def lock_through(self, stop: int) -> None:
        """Page-lock chunks until bytes ``[0, stop)`` are; on a failure warn (once per process) and leave the rest
        pageable (copies into it are correct, only synchronous)."""
        while self.locked < stop and self.registrar is not None:
            chunk = self.memory[self.locked : self.locked + CHUNK_BYTES]
            try:
                self.registrar.register(chunk, self.device)
            except Exception as exc:  # noqa: BLE001 - any failure to page-lock falls back, the save goes on
                self.registrar.clear_error(self.device)  # or this thread's next kernel launch fails for it
                warn_once(exc)
                self.registrar, self.failed, self.locked = None, True, self.nbytes
                return
            self._pointers.append(chunk.data_ptr())
            self.locked += chunk.numel()

    def cuts(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``[start, stop)`` cut at chunk boundaries (no copy spans two registrations), as offsets from ``start``."""
        bounds = [start, *range((start // CHUNK_BYTES + 1) * CHUNK_BYTES, stop, CHUNK_BYTES), stop]
        return [(a - start, b - start) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _unregister_all(registrar: Registrar, pointers: list[int], device: torch.device) -> None:
    for pointer in pointers:
        registrar.unregister(pointer, device)


def _fallback(nbytes: int, device: torch.device) -> torch.Tensor:
    """The caching host allocator's pinned memory (rounded up by it), or pageable memory where there is none."""
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return torch.empty(nbytes, dtype=torch.uint8)


_warned = threading.Event()


def warn_once(exc: BaseException) -> None:
    """The one warning a process gives when page-locking fails (every later save would say the same)."""
    if not _warned.is_set():
        _warned.set()
        warnings.warn(
            f"async saves stage through ordinary pinned or pageable host memory: page-locking failed ({exc}); "
            "the copies are correct but may take longer",
            RuntimeWarning,
            stacklevel=3,
        )


@dataclass
class StagedCopy:
    """One async save's copy into host memory: ``issued`` once every copy is done (host tensors) or enqueued
    (GPU tensors, each GPU's last copy recorded in ``done``), ``staged`` once the host holds every byte."""

    issued: threading.Event = field(default_factory=threading.Event)
    staged: threading.Event = field(default_factory=threading.Event)
    done: list[tuple[Copier, Any]] = field(default_factory=list)  # per GPU: a ticket after its last copy

    def before_change(self) -> None:
        """Before the live state changes (``optim.step()``, ``load_state_dict()``, a load): the host waits until the
        copies are enqueued; the caller's stream then waits, on the GPU, until they are done."""
        self.issued.wait()
        for copier, ticket in self.done:
            copier.hold(ticket)

    def finish(self) -> None:
        """Never left unset: a step waiting for a failed save must not hang."""
        self.issued.set()
        self.staged.set()


# Keyed by what an async save copies: its optimizer (the state) and its root module (the weights and buffers).
_pending: weakref.WeakKeyDictionary[torch.optim.Optimizer | torch.nn.Module, StagedCopy] = weakref.WeakKeyDictionary()


def expect(owner: torch.optim.Optimizer | torch.nn.Module, staged: StagedCopy) -> None:
    """Record that ``owner``'s state (an optimizer's, or a root module's weights) is being copied by ``staged``."""
    _pending[owner] = staged


def before_change(owner: torch.optim.Optimizer | torch.nn.Module | None) -> None:
    """What anything that changes ``owner`` (an optimizer's state, a root module's weights) calls first: the last
    async save's copy of it is enqueued (host) and done before the caller's stream goes on (GPU)."""
    staged = _pending.get(owner) if owner is not None else None
    if staged is not None:
        staged.before_change()


_ALIGN = 512  # bytes: every staged tensor starts aligned in the arena


class HostStaging:
    """Host memory for one root's shards, kept across saves: a plain buffer per host tensor, ``(flat, key)`` -> a
    tensor of that shape and dtype, and one :class:`Arena` for the shards on GPUs. ``engines`` and ``registrar``: the
    copy engines and how memory is page-locked (CUDA's unless a test's)."""

    def __init__(self, engines: Engines = CUDA, registrar: Registrar | None = CUDA_HOST) -> None:
        self.engines = engines
        self.registrar = registrar
        self.host: dict[tuple[int, str], torch.Tensor] = {}
        self.arena: Arena | None = None
        self.layout: tuple[tuple[tuple[int, str], torch.Size, torch.dtype], ...] = ()
        self.views: dict[tuple[int, str], tuple[int, torch.Tensor]] = {}  # (flat, key) -> (byte offset, view)
        self.side: dict[str, torch.Tensor] = {}  # name -> pinned copy of a GPU tensor (:meth:`side_copy`)

    def copy(self, state: Mapping[int, Mapping[str, Any]], ready: Mapping[Copier, Any], staged: StagedCopy) -> Any:
        """``state`` (``{flat: {key: live tensor or value}}``) copied into this root's memory, in the save's thread:
        host tensors at once, GPU tensors enqueued after ``ready[copier]``, straight into the arena once it is
        page-locked, else through the copier's ring (the module docstring); sets ``staged.issued``, waits for the GPU
        copies, sets ``staged.staged``. Returns the copy, same shape."""
        on_gpu = [((i, k), v.detach(), c) for i, e in state.items() for k, v in e.items() if (c := self._of(v))]
        if on_gpu:
            on_gpu[0][2].bind()  # this thread's CUDA calls go to the shards' GPU, not GPU 0
        out: dict[int, dict[str, Any]] = {i: {} for i in state}
        copiers: list[Copier] = []
        try:
            self._fit([(key, v.shape, v.dtype) for key, v, _ in on_gpu], on_gpu[0][2].device if on_gpu else None)
            locked = self.arena is None or self.arena.locked == self.arena.nbytes
            ringed: dict[Copier, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for (i, key), value, copier in on_gpu:
                if copier not in copiers:
                    copiers.append(copier)
                    copier.after(ready[copier])
                if locked or not value.is_contiguous():
                    out[i][key] = self._queue(copier, (i, key), value)
                else:
                    out[i][key] = self.views[(i, key)][1]
                    ringed.setdefault(copier, []).append((out[i][key], value))
            for copier, pairs in ringed.items():
                _through_ring(self.engines.ring(copier), pairs)
            for i, entries in state.items():
                for key, value in entries.items():
                    if key not in out[i]:
                        out[i][key] = self._host_copy(i, key, value)
        finally:  # every copy queued has landed before this returns or raises: the arena may be freed after it
            staged.done = [(copier, copier.last()) for copier in copiers]
            staged.issued.set()
            for copier, ticket in staged.done:
                copier.wait(ticket)
        staged.staged.set()
        return {i: {k: out[i][k] for k in state[i]} for i in state}  # the state's own order

    def lock(self) -> None:
        """Page-lock this root's arena where it is not yet (the save's thread, once its upload is done); after a
        failure the next save takes the fallback memory."""
        arena = self.arena
        if arena is None or self.registrar is None:
            return
        arena.lock_through(arena.nbytes)
        if arena.failed:  # no arena tries to page-lock again
            self.registrar, self.arena, self.layout, self.views = None, None, (), {}

    def side_copy(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], list[tuple[Copier, Any]]]:
        """The buffers and ``extra``'s tensors (``{name: tensor}``) copied in the caller's thread: host tensors at once,
        GPU tensors queued after a mark taken now into this root's pinned memory, the caller's stream made to wait for
        them on the GPU (a forward changes buffers in place), the host for nothing. Returns the copies (``{name: host
        tensor}``, each valid once its GPU's ticket is done) and ``[(copier, ticket)]``."""
        out, copiers = {}, []
        for name, value in tensors.items():
            copier = self._of(value)
            if copier is None:
                out[name] = self._host_copy(-1, name, value)
                continue
            buffer = self.side.get(name)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                raw = copier.buffer(value.numel() * value.element_size())
                buffer = self.side[name] = raw.view(value.dtype).view(value.shape)
            if copier not in copiers:
                copiers.append(copier)
                copier.after(copier.mark())
            out[name] = buffer
            copier.copy(buffer, value.detach())
        tickets = [(copier, copier.last()) for copier in copiers]
        for copier, ticket in tickets:
            copier.hold(ticket)
        return out, tickets

    def _queue(self, copier: Copier, key: tuple[int, str], value: torch.Tensor) -> torch.Tensor:
        """Queue the copy of ``value`` into its view, cut at the arena's chunk boundaries (no copy spans two
        registrations); the view."""
        at, view = self.views[key]
        nbytes = value.numel() * value.element_size()
        arena = self.arena
        assert arena is not None, "a shard to stage has an arena"
        if not value.is_contiguous():
            copier.copy(view, value)  # rare (a strided state tensor): one copy, correct whatever the registration
            return view
        raw, into = value.reshape(-1).view(torch.uint8), view.reshape(-1).view(torch.uint8)
        for a, b in arena.cuts(at, at + nbytes):
            copier.copy(into[a:b], raw[a:b])
        return view

    @property
    def buffers(self) -> int:
        """How many tensors this root's staging holds memory for (host buffers and arena views)."""
        return len(self.host) + len(self.views)

    def _of(self, value: Any) -> Copier | None:
        return self.engines.of(value) if torch.is_tensor(value) else None

    def _fit(self, specs: list[tuple[tuple[int, str], torch.Size, torch.dtype]], device: torch.device | None) -> None:
        """The arena and its views for these shards: the views kept when the shapes and dtypes are those of the last
        save; the arena kept when they fit in it and fill half of it or more (nothing registered again)."""
        layout = tuple(specs)
        if layout == self.layout:
            return
        offsets, total = [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            total += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
        arena, self.layout, self.views = self.arena, (), {}
        if arena is None or not (total <= arena.nbytes < 2 * total) or arena.device != device:
            self.arena = arena = None  # the old arena is released (and unregistered) first
            if total and device is not None:
                arena = Arena.allocate(total, device, self.registrar)
        views = {}
        for (key, shape, dtype), at in zip(layout, offsets, strict=True):
            assert arena is not None, "a shard to stage has an arena"
            views[key] = (at, arena.memory[at : at + shape.numel() * dtype.itemsize].view(dtype).view(shape))
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


def _through_ring(ring: Ring, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each GPU tensor's bytes into its host view (``(view, tensor)`` pairs, contiguous) through ``ring``'s
    page-locked slots: a slot's bytes copied into place on the host while the copies into the next slots run."""
    slot = ring.slot_bytes
    spans = (raw[a : a + slot] for view, _ in pairs for raw in [view.reshape(-1).view(torch.uint8)]
             for a in range(0, raw.numel(), slot))  # fmt: skip
    with closing(ring.pieces([value.reshape(-1) for _, value in pairs])) as pieces:
        for piece, span in zip(pieces, spans, strict=True):
            span.copy_(piece)


def ready_events(state: Mapping[int, Mapping[str, Any]], engines: Engines = CUDA) -> dict[Copier, Any]:
    """A :meth:`~fsdp_optim.job.stager.Copier.mark` on every device that holds a tensor of ``state``, taken in the
    caller's thread when a save is called."""
    copiers = {c for entries in state.values() for v in entries.values() if torch.is_tensor(v) and (c := engines.of(v))}
    return {c: c.mark() for c in copiers}
