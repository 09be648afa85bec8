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
from typing import Any

import torch

from fsdp_optim.job.stager import CudaCopier, copier_of, mark

__all__ = ["Staged", "Staging", "before_change", "expect", "pinned", "ready_events"]


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


# Keyed by what an async save copies: its optimizer (the state) and its root module (the weights and buffers).
_pending: weakref.WeakKeyDictionary[torch.optim.Optimizer | torch.nn.Module, Staged] = weakref.WeakKeyDictionary()


def expect(owner: torch.optim.Optimizer | torch.nn.Module, staged: Staged) -> None:
    """Record that ``owner``'s state (an optimizer's, or a root module's weights) is being copied by ``staged``."""
    _pending[owner] = staged


def before_change(owner: torch.optim.Optimizer | torch.nn.Module | None) -> None:
    """What anything that changes ``owner`` (an optimizer's state, a root module's weights) calls first: the last
    async save's copy of it is enqueued (host) and done before the caller's stream goes on (GPU). Nothing when none is
    pending."""
    staged = _pending.get(owner) if owner is not None else None
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
                    copiers[value.device] = copier_of(value.device)
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
