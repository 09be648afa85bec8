"""Async saves' staging: a root's reused host memory for its shards, copied on the stager's side stream, and the
wait that whatever changes the state next goes through (:func:`before_change`).

One arena per root for its shards on GPUs, page-locked with CUDA at its exact size and kept across saves (host
memory does not grow from one save to the next); a plain buffer per host tensor. The copies are enqueued by the
save's thread after an event taken in the caller's thread when the save was called (:func:`ready_events`), so they
see the state at the call; ``optim.step()``, ``load_state_dict()`` and the loads wait for them on the GPU (the
host waits only until they are enqueued). See :mod:`fsdp_optim.job.stager` for the copies themselves.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fsdp_optim.job.stager import CUDA, Copier, Engines

__all__ = ["CUDA_HOST", "CudaHost", "Registrar", "Staged", "Staging", "before_change", "expect", "ready_events"]


@dataclass
class Staged:
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


class Registrar(Protocol):
    """How host memory is page-locked for a device's copies (CUDA: ``cudaHostRegister``); injectable for tests."""

    def register(self, memory: torch.Tensor, device: torch.device) -> None:
        """Page-lock ``memory``'s bytes for copies with ``device``; raises when it cannot."""
        ...

    def unregister(self, pointer: int, device: torch.device) -> None:
        """Undo :meth:`register` of the memory starting at ``pointer``."""
        ...


class CudaHost:
    """``cudaHostRegister`` / ``cudaHostUnregister``, each under its GPU's context (a save's thread would otherwise
    open one on GPU 0 for every rank)."""

    def register(self, memory: torch.Tensor, device: torch.device) -> None:
        nbytes = memory.numel() * memory.element_size()
        with torch.cuda.device(device):
            code = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, 0))
        if code != 0:
            raise RuntimeError(f"cannot page-lock {nbytes} bytes of host memory for staging (CUDA error {code})")

    def unregister(self, pointer: int, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(pointer)


CUDA_HOST = CudaHost()


class Staging:
    """Host memory for one root's shards, kept across saves: a plain buffer per host tensor, ``(flat, key)`` -> a
    tensor of that shape and dtype, and one pinned arena for the shards on GPUs (registered with CUDA at its exact
    size: the caching host allocator would round each block up to a power of two, up to twice the state).
    ``engines`` and ``registrar``: the copy engines and how memory is page-locked (CUDA's unless a test's)."""

    def __init__(self, engines: Engines = CUDA, registrar: Registrar = CUDA_HOST) -> None:
        self.engines = engines
        self.registrar = registrar
        self.host: dict[tuple[int, str], torch.Tensor] = {}
        self.arena: torch.Tensor | None = None
        self.layout: tuple[tuple[tuple[int, str], torch.Size, torch.dtype], ...] = ()
        self.views: dict[tuple[int, str], torch.Tensor] = {}

    def copy(self, state: Mapping[int, Mapping[str, Any]], ready: Mapping[Copier, Any], staged: Staged) -> Any:
        """``state`` (``{flat: {key: live tensor or value}}``) copied into this root's memory: host tensors at once,
        GPU tensors enqueued after ``ready[copier]`` (:func:`ready_events`, taken when the save was called); sets
        ``staged.issued``, waits for the GPU copies, sets ``staged.staged``. Returns the copy, same shape."""
        on_gpu = [((i, k), v.detach(), c) for i, e in state.items() for k, v in e.items() if (c := self._of(v))]
        self._fit([(key, v.shape, v.dtype) for key, v, _ in on_gpu], on_gpu[0][2].device if on_gpu else None)
        out: dict[int, dict[str, Any]] = {i: {} for i in state}
        copiers: list[Copier] = []
        try:
            for (i, key), value, copier in on_gpu:
                if copier not in copiers:
                    copiers.append(copier)
                    copier.after(ready[copier])
                out[i][key] = self.views[(i, key)]
                copier.copy(out[i][key], value)
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

    @property
    def buffers(self) -> int:
        """How many tensors this root's staging holds memory for (host buffers and arena views)."""
        return len(self.host) + len(self.views)

    def _of(self, value: Any) -> Copier | None:
        return self.engines.of(value) if torch.is_tensor(value) else None

    def _fit(self, specs: list[tuple[tuple[int, str], torch.Size, torch.dtype]], device: torch.device | None) -> None:
        """The arena and its views for these shards: kept when the shapes and dtypes are those of the last save."""
        layout = tuple(specs)
        if layout == self.layout:
            return
        offsets, total = [], 0
        for _, shape, dtype in layout:
            offsets.append(total)
            total += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
        self.arena, self.layout, self.views = None, (), {}  # the old arena is released (and unregistered) first
        arena = self._pinned(total, device) if total and device is not None else None
        views = {}
        for (key, shape, dtype), at in zip(layout, offsets, strict=True):
            assert arena is not None, "a shard to stage has an arena"
            views[key] = arena[at : at + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        self.arena, self.layout, self.views = arena, layout, views

    def _pinned(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of host memory page-locked at exactly that size, unregistered when the returned tensor is
        dropped (views cut from it may outlive it: host reads need no registration, and its owner copies into it
        only while it holds it)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.registrar.register(buffer, device)
        weakref.finalize(buffer, self.registrar.unregister, buffer.data_ptr(), device)
        return buffer

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


def ready_events(state: Mapping[int, Mapping[str, Any]], engines: Engines = CUDA) -> dict[Copier, Any]:
    """A :meth:`~fsdp_optim.job.stager.Copier.mark` on every device that holds a tensor of ``state``: taken in the
    caller's thread when a save is called (the copies, made later by the save's thread, must see the state as it
    was then)."""
    copiers = {c for entries in state.values() for v in entries.values() if torch.is_tensor(v) and (c := engines.of(v))}
    return {c: c.mark() for c in copiers}
