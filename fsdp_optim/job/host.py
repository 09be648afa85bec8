"""Host execution: fairscale's FullyShardedDataParallel on CPU with a gloo process group.

The fairscale adapter: every use of fairscale's private names lives here. fairscale 0.4.13 assumes CUDA in places
that have nothing to do with the maths of sharding. On a CPU every operation is synchronous and there is nothing to
pin or move, so each is a no-op by definition; while on, the switch (:func:`host_execution`, or
:func:`enable_host_execution` / :func:`disable_host_execution`) makes it one:

1. fairscale enters ``torch.cuda.stream(...)``, asks ``torch.cuda.current_stream()`` and calls
   ``torch.cuda.synchronize()`` unconditionally (backward hooks, ``summon_full_params``, ``load_local_state_dict``),
   and indexes streams it creates only ``if torch.cuda.is_available()``: the name ``torch`` *inside fairscale's FSDP
   module only* becomes a view of torch whose ``cuda`` hands out :class:`HostStream` objects and no-op
   synchronisation (everything else is the real torch), and the root instance gets such streams (``_setup_streams``);
2. it calls ``Tensor.record_stream``, which has no CPU kernel: a no-op CPU kernel is registered (unless one is);
3. its reduce-scatter bucket hands a 2-D input to ``_reduce_scatter_base``, which gloo rejects: the list form is
   used, as fairscale does when ``ENABLE_NCCL_BASE_COLLECTIVES=0`` (for its parameter all-gather too: no deprecated
   ``_all_gather_base``);
4. with ``move_params_to_cpu`` / ``cpu_offload`` / ``move_grads_to_cpu`` it pins the CPU copies (which raises "Cannot
   access accelerator device when none is available"), ``clip_grad_norm_`` moves the local norm with ``.cuda()``,
   and its default ``compute_device`` is ``cuda``: ``_init_param_attributes`` and ``clip_grad_norm_`` run with
   ``pin_memory()`` and ``cuda()`` returning the tensor itself (:mod:`.host_fixes`: no other code sees it), and the
   default compute device is the CPU;
5. its ``gather_full_optim_state_dict`` receives every state key into one reused buffer and keeps ``x.cpu()`` of it,
   the very same tensor on a CPU (Adam's ``exp_avg`` equal to ``exp_avg_sq``), and turns the live optimizer's
   ``step`` tensors into numbers, after which ``Adam.step()`` raises: ``cpu()`` of a CPU tensor copies there, and
   the ``step`` values are put back (``tests/test_fairscale_methods_and_errors.py``);
6. one fairscale bug that is not about CUDA (fairscale issue #1193 and PR #1149 report it from GPU jobs):
   ``load_local_state_dict`` before the first forward of a model with nested units frees full parameters that were
   never made and raises ``'FlatParameter' object has no attribute '_full_param_padded'``: ``_free_full_params``
   skips the parameters that have none (on a GPU, call ``model.local_state_dict()`` once before loading);
7. torch's ``TypedStorage`` deprecation, warned where fairscale's constructor first calls ``Tensor.storage()``, is
   silenced there: a warning nobody using the package can act on.

Leaving the switch (the outermost exit) restores every one of these names to the very object it was and
destroys the ``record_stream`` registration (``torch.library.Library._destroy``), so fairscale is exactly
as imported. Constructing ``fsdp_optim.FullyShardedDataParallel`` on a machine without CUDA enables the
switch for the rest of the process instead (:func:`enable_for_process`) when the model computes on the CPU
(:func:`fsdp_optim.job.fsdp.computes_on_host`: where fairscale computes it; CPU parameters without CPU offload on
any machine): such a model may be used anywhere. A model that computes on a GPU leaves fairscale untouched; the two
kinds cannot share one process, because the switch is process-wide (:func:`note_cuda_root`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fsdp_optim.job.host_fixes import copying_to_host, keeping_the_optimizer, quietly, without_transfers

__all__ = [
    "HostStream",
    "disable_host_execution",
    "enable_for_process",
    "enable_host_execution",
    "host_execution",
    "is_enabled",
    "note_cuda_root",
    "new_stream",
]


class _Param(Protocol):
    """One of fairscale's flat parameters, as the switch reads it."""

    _is_sharded: bool


class _Instance(Protocol):
    """What the switch's replacements touch of one of fairscale's FSDP instances (fairscale ships no types)."""

    _is_root: bool | None
    _streams: dict[str, torch.Stream]
    params: list[_Param]


class HostStream(torch.Stream):
    """A CPU stand-in for ``torch.cuda.Stream``: a real ``torch.Stream`` whose waits are no-ops."""

    def wait_stream(self, stream: torch.Stream) -> None:  # noqa: ARG002 - CPU work is already ordered
        return None

    def wait_event(self, event: torch.Event) -> None:  # noqa: ARG002
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

    def synchronize(self, device: torch.device | int | str | None = None) -> None:  # noqa: ARG002
        return None

    def current_stream(self, device: torch.device | int | str | None = None) -> torch.Stream:  # noqa: ARG002
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


_TORCH_VIEW = _TorchWithHostCuda()


def _with_host_streams(setup_streams: Callable[[_Instance], None]) -> Callable[[_Instance], None]:
    @functools.wraps(setup_streams)
    def wrapper(self: _Instance) -> None:
        setup_streams(self)
        if self._is_root and not self._streams:
            # fairscale made no streams (no CUDA), yet indexes them on every forward and backward. The
            # dict is already shared with every child instance, so filling it in place reaches them too.
            for name in ("fp32_to_fp16", "all_gather", "post_backward"):
                self._streams[name] = new_stream()

    return wrapper


def _free_only_made(free_full_params: Callable[..., None]) -> Callable[..., None]:
    """fairscale's ``_free_full_params`` over only the parameters whose full buffers exist (the module docstring's
    item 6: ``_init_param_attributes`` makes them only on an instance's first use); the rest is fairscale's code."""

    @functools.wraps(free_full_params)
    def wrapper(self: _Instance, params: list[_Param] | None = None) -> None:
        chosen = self.params if params is None else params
        made = [p for p in chosen if hasattr(p, "_full_param_padded" if p._is_sharded else "_fp16_shard")]
        free_full_params(self, made)  # also when nothing was made: it marks the instance as holding none

    return wrapper


def _default_compute_device(module: torch.nn.Module) -> torch.device:  # noqa: ARG001 - no CUDA: the CPU
    return torch.device("cpu")


def _record_stream_on_host(tensor: torch.Tensor, stream: torch.Stream) -> None:  # noqa: ARG001
    return None


_ABSENT = object()


@dataclass(frozen=True)
class _Patch:
    """One name replaced while the switch is on; ``original`` is what ``owner.__dict__`` held (or absent)."""

    owner: object  # a module or a class
    name: str
    original: object

    def restore(self) -> None:
        if self.original is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


def _replacements() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, name, original -> replacement) for every fairscale name the switch replaces."""
    import fairscale.internal.reduce_scatter_bucketer as bucketer
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fairscale_fsdp

    cls = fairscale_fsdp.FullyShardedDataParallel
    return [
        (fairscale_fsdp, "torch", lambda _: _TORCH_VIEW),
        (fairscale_fsdp, "_get_default_cuda_device", lambda _: _default_compute_device),
        (bucketer, "enable_nccl_base_collectives", lambda _: False),
        (fairscale_fsdp, "enable_nccl_base_collectives", lambda _: False),
        (cls, "_setup_streams", _with_host_streams),
        (cls, "_init_param_attributes", without_transfers),
        (cls, "clip_grad_norm_", without_transfers),
        (cls, "_free_full_params", _free_only_made),
        (cls, "_shard_parameters_", quietly),
        (cls, "_gather_optim_state", copying_to_host),
        (cls, "gather_full_optim_state_dict", keeping_the_optimizer),
    ]


@dataclass
class _Switch:
    """The switch's one process-wide state, changed only under ``_lock`` (mutable: it is the switch)."""

    depth: int = 0  # enables not yet matched by a disable
    for_process: bool = False  # enable_for_process() ran: never restored
    patches: list[_Patch] = field(default_factory=list)  # what is replaced now; empty while off
    library: torch.library.Library | None = None  # holding our record_stream kernel, if we registered one
    cuda_roots: int = 0  # instances of ours built here that compute on a GPU (host execution would break them)


_lock = threading.RLock()
_state = _Switch()


def is_enabled() -> bool:
    return bool(_state.patches)


def _switch_on() -> None:
    """Apply the patches unless they are on (under ``_lock``)."""
    if _state.cuda_roots:
        raise RuntimeError(
            "host execution replaces fairscale's CUDA streams with CPU stand-ins for the whole process, but this "
            f"process already built {_state.cuda_roots} FSDP instance(s) that compute on a GPU; run CPU and GPU FSDP "
            "models in separate processes"
        )
    if not is_enabled():
        _apply()


def note_cuda_root() -> None:
    """Record that an instance computing on a GPU was built here; refused while host execution is on."""
    with _lock:
        if is_enabled():
            raise RuntimeError(
                "this process runs fairscale's FSDP on the CPU (host execution replaces its CUDA streams with CPU "
                "stand-ins for the whole process), so an instance that computes on a GPU cannot be built here; run CPU "
                "and GPU FSDP models in separate processes, or put this model on the CPU"
            )
        _state.cuda_roots += 1


def _apply() -> None:
    applied: list[_Patch] = []
    try:
        for owner, name, replace in _replacements():
            original = owner.__dict__.get(name, _ABSENT)
            replacement = replace(getattr(owner, name))
            applied.append(_Patch(owner, name, original))
            setattr(owner, name, replacement)
        if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::record_stream", "CPU"):
            library = torch.library.Library("aten", "IMPL")
            library.impl("record_stream", _record_stream_on_host, "CPU")
            _state.library = library
    except BaseException:
        for patch in reversed(applied):
            patch.restore()
        raise
    _state.patches = applied


def _restore() -> None:
    for patch in reversed(_state.patches):
        patch.restore()
    _state.patches = []
    library = _state.library
    if library is not None:
        library._destroy()  # unregisters the record_stream kernel
        _state.library = None


def enable_host_execution() -> None:
    """Switch fairscale's FSDP to host execution (CPU, gloo); pair every call with :func:`disable_host_execution`.

    Reference-counted: calls nest, and fairscale is restored when the last enable is matched by a
    disable. Build and run the FSDP models (fairscale's own class or ours) while it is on: with the
    module on CPU, a gloo process group and ``compute_device=torch.device("cpu")`` (the default while
    on). An instance used after the switch is off again fails on its next forward or backward.

    Works on machines with or without GPUs: what it replaces concerns fairscale's module, process-wide, so it
    raises ``RuntimeError`` when this process already built an ``fsdp_optim.FullyShardedDataParallel`` instance that
    computes on a GPU.
    """
    with _lock:
        _switch_on()
        _state.depth += 1


def disable_host_execution() -> None:
    """Undo one :func:`enable_host_execution`; the last one restores fairscale's module exactly.

    Every replaced name gets back the object it held before, and the ``aten::record_stream`` CPU kernel registered
    by the switch is unregistered. While ``fsdp_optim.FullyShardedDataParallel`` has enabled host execution for the
    process, nothing is restored.

    Raises ``RuntimeError`` when not matched by an earlier enable.
    """
    with _lock:
        if _state.depth == 0:
            raise RuntimeError("disable_host_execution() called without a matching enable_host_execution()")
        _state.depth -= 1
        if _state.depth == 0 and not _state.for_process:
            _restore()


@contextlib.contextmanager
def host_execution() -> Iterator[None]:
    """Run fairscale's FullyShardedDataParallel on CPU with gloo inside a ``with`` block (nests)::

        with fsdp_optim.host_execution():
            model = fairscale.nn.FullyShardedDataParallel(net, compute_device=torch.device("cpu"))
            ...train, state_dict(), local_state_dict(), load_local_state_dict()...

    The same as :func:`enable_host_execution` on entry and :func:`disable_host_execution` on exit.
    """
    enable_host_execution()
    try:
        yield
    finally:
        disable_host_execution()


def enable_for_process() -> None:
    """Enable host execution until the process ends (what ``fsdp_optim.FullyShardedDataParallel`` does); idempotent,
    and apart from :func:`enable_host_execution`'s count, so an unbalanced user disable cannot switch it off."""
    with _lock:
        _switch_on()
        _state.for_process = True
