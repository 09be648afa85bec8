"""What the host switch (:mod:`fsdp_optim.job.host`) wraps fairscale's methods in, beyond moving no bytes.

- :func:`copying_to_host`: ``Tensor.cpu()`` of a CPU tensor returns a copy, as it does from a GPU.
  fairscale's ``_gather_optim_state`` receives every state key into one reused buffer and keeps
  ``x.cpu()`` of it; on a CPU that is the buffer itself, so every key of a parameter ended up holding
  the last key's values (Adam's ``exp_avg`` equal to ``exp_avg_sq``).
- :func:`keeping_the_optimizer`: fairscale's ``gather_full_optim_state_dict`` turns the live optimizer's
  ``step`` tensors into Python numbers (after which ``Adam.step()`` raises); the values are put back.
- :func:`quiet` / :func:`quietly`: deprecation warnings raised inside fairscale's code that nobody using
  it can act on, filtered only while the wrapped call runs (never process-wide).

Pure wrappers: no fairscale name is read here; :mod:`fsdp_optim.job.host` decides what they wrap.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["QUIET", "copying_to_host", "keeping_the_optimizer", "quiet", "quietly"]


class _CopyOnHost(TorchFunctionMode):
    """``Tensor.cpu()`` of a CPU tensor returns a copy, as it does from a GPU; every other call runs as is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.cpu and args[0].device.type == "cpu":
            return args[0].clone()
        return func(*args, **(kwargs or {}))


def copying_to_host(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CopyOnHost():
            return method(*args, **kwargs)

    return wrapper


def keeping_the_optimizer(gather: Callable[..., Any]) -> Callable[..., Any]:
    """fairscale's gather with every live ``step`` value put back afterwards (it turns them into floats)."""

    @functools.wraps(gather)
    def wrapper(self: Any, optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        steps = [(state, state["step"]) for state in optim.state.values() if "step" in state]
        try:
            return gather(self, optim, *args, **kwargs)
        finally:
            for state, step in steps:
                state["step"] = step

    return wrapper


# Deprecations raised inside fairscale's code that nobody using it can act on; filtered only while our
# wrappers run (``warnings.catch_warnings``), never process-wide.
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


def quietly(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with quiet():
            return method(*args, **kwargs)

    return wrapper
