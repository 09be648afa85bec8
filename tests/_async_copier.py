"""A test double of a GPU's copy engine, for machines without one: copies that land later, in order, on a worker
thread of their own, each after a random delay, and events that are real waits.

This does not mock a collective, FSDP or the file system. It models the one piece of hardware the CPU lacks: a GPU
copy engine, which runs the copies queued on a stream in order, some time after the host queued them, while the host
goes on. ``copy()`` returns at once; the copy reads its source and writes its destination later, so a caller that
reads a destination before waiting for its ticket, reuses a buffer whose copy is still in flight, frees memory a
copy may still write into, or changes a source before its copy has read it, gets wrong bytes here as it would on a
GPU. ``mark()`` is done at once (the host, here the "compute stream", has already run whatever it queued), and
``hold()`` makes the host wait (what the caller does next runs on the host). A ticket's ``query()`` answers
truthfully and its ``synchronize()`` blocks until the copy has landed.

:class:`AsyncEngines` places chosen host tensors "on" such devices (by their storage), so the stager's ring, an
async save's arena and the staging order run under it unchanged; everything else is host memory, read where it is.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fsdp_optim.job.stager import Copier, Ring

__all__ = ["AsyncCopier", "AsyncEngines", "Recorder", "Ticket"]

TIMEOUT = 60.0  # seconds: a ticket never done is a test failure, not a hang


class Ticket:
    """An event of the fake device: set by the worker once everything queued before it has run."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(TIMEOUT):
            raise TimeoutError(f"a copy was not done after {TIMEOUT} s")

    def _set(self) -> None:
        self._done.set()


class AsyncCopier:
    """One fake device's copy engine: a FIFO of copies run by a worker thread, each after ``0..max_delay`` seconds.

    ``fail_at=n`` makes the n-th ``copy()`` call raise at once, as a CUDA launch error would, after the earlier
    ones were queued. ``log`` records ``("copy", n)`` when the n-th copy lands; ``queued`` counts the copies queued,
    ``landed`` those landed and ``bytes_landed`` their bytes.
    """

    def __init__(self, name: str = "fake:0", *, seed: int = 0, max_delay: float = 0.002, fail_at: int | None = None):
        self.name = name
        self.device = torch.device("cpu")  # its "device memory" is host memory placed on it by AsyncEngines
        self.queued = 0
        self.landed = 0
        self.bytes_landed = 0
        self.fail_at = fail_at
        self.log: list[tuple[str, int]] = []
        self._rng = random.Random(seed)
        self._max_delay = max_delay
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._work, name=f"async-copier-{name}", daemon=True).start()

    def __repr__(self) -> str:
        return f"AsyncCopier({self.name!r})"

    def _work(self) -> None:
        while True:
            self._jobs.get()()

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def mark(self) -> Any:
        return Ticket(done=True)

    def after(self, event: Any) -> None:
        self._jobs.put(event.synchronize)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise ValueError(f"a copy of {src.numel() * src.element_size()} bytes into {dst.numel() * dst.element_size()}")
        self.queued += 1
        if self.fail_at == self.queued:
            raise RuntimeError(f"{self.name}: copy {self.queued} failed to launch")
        ticket, number, delay = Ticket(), self.queued, self._rng.uniform(0, self._max_delay)

        def land() -> None:
            time.sleep(delay)
            with torch.no_grad():  # the source is read now, not when the copy was queued
                dst.view(-1).view(torch.uint8).copy_(src.detach().contiguous().view(-1).view(torch.uint8))
            self.landed += 1
            self.bytes_landed += dst.numel() * dst.element_size()
            self.log.append(("copy", number))
            ticket._set()

        self._jobs.put(land)
        return ticket

    def wait(self, ticket: Any) -> None:
        ticket.synchronize()

    def last(self) -> Any:
        ticket = Ticket()
        self._jobs.put(ticket._set)
        return ticket

    def hold(self, ticket: Any) -> None:
        ticket.synchronize()

    def bind(self) -> None:
        return None

    def in_flight(self) -> int:
        """Copies queued and not yet landed (the launch that failed is not counted)."""
        return self.queued - self.landed - (1 if self.fail_at is not None and self.fail_at <= self.queued else 0)


class AsyncEngines:
    """Places host tensors on fake devices (:meth:`place`); a tensor not placed is host memory."""

    def __init__(self, *copiers: AsyncCopier, slots: int = 3, slot_bytes: int = 64) -> None:
        self.copiers = copiers or (AsyncCopier(),)
        self._placed: dict[int, AsyncCopier] = {}
        self._rings: dict[int, Ring] = {}
        self._slots, self._slot_bytes = slots, slot_bytes

    def place(self, tensor: torch.Tensor, device: int = 0) -> torch.Tensor:
        """Say that ``tensor``'s memory is on fake device ``device``; returns it."""
        self._placed[tensor.untyped_storage().data_ptr()] = self.copiers[device]
        return tensor

    def of(self, tensor: torch.Tensor) -> Copier | None:
        return self._placed.get(tensor.untyped_storage().data_ptr())

    def ring(self, copier: Copier) -> Ring:
        key = id(copier)
        if key not in self._rings:
            self._rings[key] = Ring(copier, slots=self._slots, slot_bytes=self._slot_bytes)
        return self._rings[key]


class Recorder:
    """A registrar that page-locks nothing and records each call: ``(kind, pointer, nbytes, device, copies queued by
    then)``. ``fail_from=n``: the n-th registration and every later one raise, as ``cudaHostRegister`` does when it
    cannot (``1``: every one)."""

    def __init__(self, *, fail_from: int | None = None, copier: AsyncCopier | None = None) -> None:
        self.calls: list[tuple[str, int, int, torch.device, int]] = []
        self.fail_from = fail_from
        self.last_error = 0  # what a failed registration leaves, as cudaGetLastError would return it
        self.cleared = 0  # calls of clear_error
        self.copier = copier
        self.lock = threading.Lock()

    def registered(self) -> list[tuple[int, int]]:
        """``(pointer, nbytes)`` of each successful registration."""
        return [(p, n) for kind, p, n, _, _ in self.calls if kind == "register"]

    def register(self, memory: torch.Tensor, device: torch.device) -> None:
        nbytes = memory.numel() * memory.element_size()
        with self.lock:
            tries = sum(1 for call in self.calls if call[0] != "unregister") + 1
            failed = self.fail_from is not None and tries >= self.fail_from
            queued = self.copier.queued if self.copier is not None else 0
            self.calls.append(("failed" if failed else "register", memory.data_ptr(), nbytes, device, queued))
        if failed:
            self.last_error = 712  # as the CUDA runtime keeps it, until read
            raise RuntimeError(f"cannot page-lock {nbytes} bytes of host memory for staging (CUDA error 712)")

    def clear_error(self, device: torch.device) -> None:  # noqa: ARG002
        with self.lock:
            self.cleared += 1
            self.last_error = 0

    def unregister(self, pointer: int, device: torch.device) -> None:
        with self.lock:
            self.calls.append(("unregister", pointer, 0, device, 0))
