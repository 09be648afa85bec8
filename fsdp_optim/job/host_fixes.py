"""What the host switch (:mod:`fsdp_optim.job.host`, items 4, 5 and 7 of its docstring) wraps fairscale's methods
in: :func:`without_transfers`, :func:`copying_to_host`, :func:`keeping_the_optimizer`, :func:`quiet` /
:func:`quietly` (filtered only while the wrapped call runs, never process-wide). Pure wrappers: no fairscale name is
read here; :mod:`fsdp_optim.job.host` decides what they wrap.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from typing import Concatenate, ParamSpec, TypeVar

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["QUIET", "copying_to_host", "keeping_the_optimizer", "quiet", "quietly", "without_transfers"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")  # one of fairscale's FSDP instances (fairscale ships no types)


class _NothingToMove(TorchFunctionMode):
    """``Tensor.pin_memory()`` and ``Tensor.cuda()`` return the tensor itself; every other call runs as is.

    Active only while one of fairscale's methods wrapped by ``without_transfers`` runs."""

    def __torch_function__(
        self, func: Callable[..., object], types: Collection[type], args: tuple = (), kwargs: dict | None = None
    ) -> object:
        if func is torch.Tensor.pin_memory or func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


class _CopyOnHost(TorchFunctionMode):
    """``Tensor.cpu()`` of a CPU tensor returns a copy, as it does from a GPU; every other call runs as is."""

    def __torch_function__(
        self, func: Callable[..., object], types: Collection[type], args: tuple = (), kwargs: dict | None = None
    ) -> object:
        if func is torch.Tensor.cpu and args[0].device.type == "cpu":
            return args[0].clone()
        return func(*args, **(kwargs or {}))


def keeping_the_optimizer(
    gather: Callable[Concatenate[S, torch.optim.Optimizer, P], R],
) -> Callable[Concatenate[S, torch.optim.Optimizer, P], R]:
    """fairscale's gather with every live ``step`` value put back afterwards (it turns them into floats)."""

    @functools.wraps(gather)
    def wrapper(self: S, optim: torch.optim.Optimizer, *args: P.args, **kwargs: P.kwargs) -> R:
        steps = [(state, state["step"]) for state in optim.state.values() if "step" in state]
        try:
            return gather(self, optim, *args, **kwargs)
        finally:
            for state, step in steps:
                state["step"] = step

    return wrapper


# Deprecations raised inside fairscale's code that nobody using it can act on.
QUIET = (
    (UserWarning, r"TypedStorage is deprecated"),
    (FutureWarning, r"`torch\.distributed\._all_gather_base` is a private function"),
    (FutureWarning, r"`torch\.distributed\._reduce_scatter_base` is a private function"),
)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Filter :data:`QUIET` for the duration of the block only."""
    with warnings.catch_warnings():
        for category, message in QUIET:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _within(context: Callable[[], AbstractContextManager[object]]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A wrapper of fairscale's methods: each call runs inside a fresh ``context()``."""

    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with context():
                return method(*args, **kwargs)

        return wrapper

    return wrap


without_transfers = _within(_NothingToMove)
copying_to_host = _within(_CopyOnHost)
quietly = _within(quiet)
