"""An async save's host arena: one allocation at the exact size of a root's shards on a GPU, page-locked a chunk at a
time in the save's thread after its first save, kept (and reused by a later layout that fits) across saves.

Page-locked after the fact: ``cudaHostRegister`` of a whole 6 GiB arena takes seconds, and no copy can be queued
into memory that is not page-locked yet. So the first save of a layout copies through the GPU's ring, whose slots are
page-locked already (:meth:`fsdp_optim.job.staging.HostStaging.copy`), and the save's thread locks the arena once its
upload is done (:meth:`~fsdp_optim.job.staging.HostStaging.lock`): the caller's ``optim.step()``, which waits on the
host until the copies are queued, never waits for a registration. Every later save, and a layout change whose shards
fit in the arena held (and fill half of it or more), copies straight into it. Chunk by chunk (:data:`CHUNK_BYTES`),
and a copy never spans two registrations (it is cut at chunk boundaries): the driver treats a copy into memory locked
by two calls as pageable.

Registration runs under the arena's GPU's context (:class:`CudaHost`): the save's thread would otherwise open a
context on GPU 0 on every rank. When it fails (no support, a locked-memory limit), the save goes on with a one-time
warning: the next save's arena is the caching allocator's pinned memory (``pin_memory=True``), or pageable memory
where that fails too.
The :class:`Registrar` is a seam: the tests page-lock nothing, or fail (``tests/_async_copier.py``).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from typing import Protocol

import torch

__all__ = ["CHUNK_BYTES", "CUDA_HOST", "Arena", "CudaHost", "Registrar"]

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
    (:meth:`lock_through`); ``registrar=None``: the memory needs no registration (allocated pinned, or pageable
    by choice). Unregistered when its ``memory`` is dropped (its owner copies into it only while it holds it; views
    cut from it may outlive it, host reads need no registration)."""

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
