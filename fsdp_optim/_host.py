"""Host execution: lets fairscale's FullyShardedDataParallel run on CPU with a gloo process group.

fairscale 0.4.13 assumes CUDA in three places that have nothing to do with the maths of sharding:

1. it enters ``torch.cuda.stream(...)``, asks ``torch.cuda.current_stream()`` and calls
   ``torch.cuda.synchronize()`` unconditionally on several paths (backward hooks, ``summon_full_params``,
   ``load_local_state_dict``);
2. it calls ``Tensor.record_stream`` on the tensors it frees, an op with no CPU kernel;
3. its reduce-scatter bucket hands a 2-D input to ``_reduce_scatter_base``, which NCCL accepts and gloo
   rejects.

On a CPU every operation is synchronous, so streams are a no-op by definition. :func:`enable` therefore

1. replaces the name ``torch`` *inside fairscale's FSDP module only* by a view of torch whose ``cuda``
   attribute hands out :class:`HostStream` objects and no-op synchronisation (everything else is the real
   torch);
2. registers a no-op CPU kernel for ``aten::record_stream`` (on CPU there is no allocator stream to
   record, so doing nothing is the correct semantics);
3. switches fairscale's bucketer to the list form of reduce-scatter, which is what fairscale itself does
   when ``ENABLE_NCCL_BASE_COLLECTIVES=0``.

It is only ever enabled when CUDA is unavailable, so on a GPU machine fairscale runs untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["HostStream", "enable", "is_enabled"]


class HostStream(torch.Stream):
    """A CPU stand-in for ``torch.cuda.Stream``: a real ``torch.Stream`` whose waits are no-ops."""

    def wait_stream(self, stream: Any) -> None:  # noqa: ARG002 - CPU work is already ordered
        return None

    def wait_event(self, event: Any) -> None:  # noqa: ARG002
        return None

    def synchronize(self) -> None:
        return None


def new_stream() -> HostStream:
    return HostStream("cpu")


class _HostCuda:
    """What fairscale's FSDP module sees as ``torch.cuda`` when CUDA is absent."""

    Stream = staticmethod(new_stream)

    def __init__(self) -> None:
        self._local = threading.local()
        self._default = new_stream()

    def is_available(self) -> bool:
        return False

    def synchronize(self, device: Any = None) -> None:  # noqa: ARG002
        return None

    def current_stream(self, device: Any = None) -> torch.Stream:  # noqa: ARG002
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self._default

    @contextlib.contextmanager
    def stream(self, stream: torch.Stream | None) -> Iterator[None]:
        # fairscale asserts ``current_stream() == the stream it entered``, so keep a real stack.
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream if stream is not None else self.current_stream())
        try:
            yield
        finally:
            stack.pop()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchWithHostCuda:
    """The real ``torch`` module except for ``cuda``."""

    cuda = _HostCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_lock = threading.Lock()
_state: dict[str, Any] = {"enabled": False, "library": None}


def is_enabled() -> bool:
    return bool(_state["enabled"])


def enable() -> None:
    """Make fairscale FSDP runnable on CPU. Idempotent; refuses when CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("host execution is only for machines without CUDA; fairscale runs unchanged on GPUs")
    with _lock:
        if _state["enabled"]:
            return
        import fairscale.internal.reduce_scatter_bucketer as bucketer
        import fairscale.nn.data_parallel.fully_sharded_data_parallel as fairscale_fsdp

        fairscale_fsdp.torch = _TorchWithHostCuda()  # type: ignore[assignment]
        bucketer.enable_nccl_base_collectives = False
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::record_stream", "CPU"):
            library = torch.library.Library("aten", "IMPL")
            library.impl("record_stream", _record_stream_on_host, "CPU")
            _state["library"] = library  # the registration lives as long as this object
        _state["enabled"] = True


def _record_stream_on_host(tensor: torch.Tensor, stream: torch.Stream) -> None:  # noqa: ARG001
    return None
