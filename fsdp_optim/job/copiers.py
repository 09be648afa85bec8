"""One device's copy engine as the host sees it (:class:`Copier`): the seam every device-to-host and host-to-device
copy of the stager goes through (:mod:`fsdp_optim.job.stager`, :mod:`fsdp_optim.job.staging`).

:class:`CudaCopier` queues the copies of one GPU on a side stream of its own, each answered by a CUDA event;
:class:`HostCopier` copies synchronously on the host. The tests model a GPU's copy engine on the CPU with a copier
whose copies land later, on a thread of their own (``tests/_async_copier.py``).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

__all__ = ["DONE", "Copier", "CudaCopier", "HostCopier", "Ticket", "mark"]


class Ticket(Protocol):
    """A copy's or a mark's answer (a CUDA event, or one done from the start on the host)."""

    def query(self) -> bool:
        """Whether it is done."""
        ...

    def synchronize(self) -> None:
        """Block the host until it is done."""
        ...


class Copier(Protocol):
    """One device's copy engine, as the host sees it: copies queued in order on a stream of their own, each answered
    by a ticket (an event: ``query()`` says whether it is done, ``synchronize()`` blocks the host until it is)."""

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

    def query(self) -> bool:
        return True

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
        return mark(self.device)

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


def mark(device: torch.device) -> torch.cuda.Event:
    """An event recorded now on ``device``'s current stream: copies made after it see everything queued before."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
