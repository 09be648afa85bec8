"""Host execution: fairscale's FullyShardedDataParallel on CPU with a gloo process group.

The fairscale adapter: every use of fairscale's private names lives here. fairscale 0.4.13 assumes CUDA
in places that have nothing to do with the maths of sharding:

1. it enters ``torch.cuda.stream(...)``, asks ``torch.cuda.current_stream()`` and calls
   ``torch.cuda.synchronize()`` unconditionally on several paths (backward hooks, ``summon_full_params``,
   ``load_local_state_dict``), and creates its streams only ``if torch.cuda.is_available()`` while later
   indexing them unconditionally;
2. it calls ``Tensor.record_stream`` on the tensors it frees, an op with no CPU kernel;
3. its reduce-scatter bucket hands a 2-D input to ``_reduce_scatter_base``, which NCCL accepts and gloo
   rejects;
4. with ``move_params_to_cpu`` / ``cpu_offload`` / ``move_grads_to_cpu`` it pins the CPU copies
   (``Tensor.pin_memory()``), which raises "Cannot access accelerator device when none is available";
5. ``clip_grad_norm_`` moves the local norm with ``.cuda()``; and without ``compute_device`` it
   defaults to ``torch.device("cuda")``;
6. its ``gather_full_optim_state_dict`` receives every state key into one reused buffer and keeps
   ``x.cpu()`` of it, a copy on a GPU but the very same tensor on a CPU: every key of a parameter ends up
   holding the last key's values (Adam's ``exp_avg`` equal to ``exp_avg_sq``); and it turns the live
   optimizer's ``step`` tensors into Python numbers, after which ``Adam.step()`` raises.

On a CPU every operation is synchronous and there is nothing to pin or move, so each of these is a
no-op by definition. The switch (:func:`host_execution`, or :func:`enable_host_execution` /
:func:`disable_host_execution`) therefore, while on,

1. replaces the name ``torch`` *inside fairscale's FSDP module only* by a view of torch whose ``cuda``
   attribute hands out :class:`HostStream` objects and no-op synchronisation (everything else is the real
   torch), and gives the root instance such streams (``_setup_streams``);
2. registers a no-op CPU kernel for ``aten::record_stream`` (on CPU there is no allocator stream to
   record), unless one is registered already;
3. switches fairscale's bucketer to the list form of reduce-scatter, which is what fairscale itself does
   when ``ENABLE_NCCL_BASE_COLLECTIVES=0``;
4. runs fairscale's ``_init_param_attributes`` with ``Tensor.pin_memory()`` returning the tensor itself,
   and ``clip_grad_norm_`` with ``Tensor.cuda()`` returning the tensor itself (a torch-function mode
   active during those two methods only: no other code sees it);
5. makes fairscale's default ``compute_device`` the CPU;
6. works around one fairscale bug that is not about CUDA (the path is the same on GPUs; fairscale issue
   #1193 and PR #1149 report it from GPU jobs): ``load_local_state_dict`` before the first forward of a
   model with nested units frees full parameters that were never made and raises ``'FlatParameter' object
   has no attribute '_full_param_padded'``; ``_free_full_params`` skips the parameters that have none. On a GPU, call
   ``model.local_state_dict()`` once before loading (it initialises every unit);
7. runs fairscale's ``_gather_optim_state`` with ``Tensor.cpu()`` of a CPU tensor returning a copy (what
   it returns from a GPU), and its ``gather_full_optim_state_dict`` with the live optimizer's ``step``
   values put back afterwards, so fairscale's own gather gives the right dict on a CPU and leaves the
   optimizer as it was (``tests/test_fairscale_methods_and_errors.py``);
8. uses the list form of fairscale's parameter all-gather too (no deprecated ``_all_gather_base``), and
   silences torch's ``TypedStorage`` deprecation inside fairscale's constructor, where fairscale first
   calls ``Tensor.storage()`` (torch warns once per process): warnings nobody using the package can act on.

Leaving the switch (the outermost exit) restores every one of these names to the very object it was and
destroys the ``record_stream`` registration (``torch.library.Library._destroy``), so fairscale is exactly
as imported. Constructing ``fsdp_optim.FullyShardedDataParallel`` on a machine without CUDA enables the
switch for the rest of the process instead (:func:`enable_for_process`) when the model computes on the CPU
(:func:`fsdp_optim.job.options.computes_on_host`: where fairscale computes it; CPU parameters without CPU offload on
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
    """fairscale's ``_free_full_params`` over only the parameters whose full buffers exist.

    Works around a fairscale bug, not the switch's (nothing on the path depends on the device; fairscale issue
    #1193 and PR #1149 report it from GPU jobs):
    ``load_local_state_dict`` lazily initialises the root instance only, then frees every nested instance's
    full parameters, which ``_init_param_attributes`` makes only on an instance's first use, so a resume
    before any forward raises ``AttributeError: 'FlatParameter' object has no attribute
    '_full_param_padded'``. A parameter never initialised has nothing to free; the rest is fairscale's code.
    """

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
    """Whether fairscale's FSDP module is currently switched to host execution."""
    return bool(_state.patches)


def _check_no_cuda_roots() -> None:
    if _state.cuda_roots:
        raise RuntimeError(
            "host execution replaces fairscale's CUDA streams with CPU stand-ins for the whole process, but this "
            f"process already built {_state.cuda_roots} FSDP instance(s) that compute on a GPU; run CPU and GPU FSDP "
            "models in separate processes"
        )


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
        _check_no_cuda_roots()
        if not is_enabled():
            _apply()
        _state.depth += 1


def disable_host_execution() -> None:
    """Undo one :func:`enable_host_execution`; the last one restores fairscale's module exactly.

    Every replaced name (the module's ``torch``, its default compute device, the bucketer's collective
    flag and its own, six methods of fairscale's ``FullyShardedDataParallel``) gets back the object it held before,
    and the ``aten::record_stream`` CPU kernel registered by the switch is unregistered. While
    ``fsdp_optim.FullyShardedDataParallel`` has enabled host execution for the process (see
    :func:`enable_for_process`), nothing is restored.

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
    """Enable host execution until the process ends (what ``fsdp_optim.FullyShardedDataParallel`` does).

    Idempotent, and independent of the count kept by :func:`enable_host_execution` /
    :func:`disable_host_execution`, so an unbalanced user disable cannot switch it off under a live model.
    """
    with _lock:
        _check_no_cuda_roots()
        if not is_enabled():
            _apply()
        _state.for_process = True
