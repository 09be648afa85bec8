"""Which optimizers fsdp_optim moves between layouts: elementwise ones, and why no others.

Pure: no ``torch.distributed``, no file access.

fairscale's FSDP hands the optimizer flat 1-D shards. An *elementwise* optimizer keeps, per parameter,
state that is either one value per parameter element (Adam's ``exp_avg``) or one scalar (``step``), and
updates each element from that element alone: its state on a flat shard is, element for element, the
state it would have on the unwrapped parameter, so it can be cut and reassembled at any world size.
A *shape-dependent* optimizer computes state from the tensor's shape: Adafactor's factored second
moment (a row and a column vector of a 2-D parameter; on a flat shard, one vector of another meaning),
LBFGS's history over all parameters at once, Muon's orthogonalised updates, LAMB's trust ratio (the norms
of each whole parameter). On a flat shard such state is not the unwrapped optimizer's, and no conversion
makes it so: fsdp_optim refuses those optimizers on every path (gather, save, get_shard, load, scatter)
with :class:`NotElementwiseError`, naming the optimizer and its state keys.

Known elementwise: :data:`TORCH_ELEMENTWISE` (``torch.optim``'s). Declare your own with
:func:`register_elementwise_optimizer` (a class, or its name as the checkpoint records it), in every
process that gathers, saves or loads its state::

    fsdp_optim.register_elementwise_optimizer(MyLion)   # update and state are per element

Checkpoints record the class *name*; offline tools (no optimizer object) refuse only names known to
be shape-dependent, since the save that wrote the checkpoint checked the class itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "SHAPE_DEPENDENT",
    "TORCH_ELEMENTWISE",
    "NotElementwiseError",
    "check_elementwise",
    "register_elementwise_optimizer",
    "state_keys",
]

TORCH_ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD", "Rprop"}
    | {"SparseAdam"}
)
SHAPE_DEPENDENT = frozenset({"Adafactor", "LBFGS", "Muon", "Shampoo", "DistributedShampoo", "SOAP", "SM3", "LAMB"})
_registered: set[str] = set()


class NotElementwiseError(NotImplementedError):
    """An optimizer whose state depends on parameter shapes (or is not known to be elementwise)."""


def register_elementwise_optimizer(optimizer: type | str) -> None:
    """Declare ``optimizer`` (a class or its ``__name__``) elementwise: its per-parameter state is one
    value per element or a scalar, and each element's update reads only that element's state. Only then
    do gather, save and load accept it. Registering a shape-dependent optimizer gives wrong state."""
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"optimizer: expected an optimizer class or its name, found {optimizer!r}")
    _registered.add(name)


def state_keys(optim: Any) -> set[str]:
    """The state keys a live optimizer holds (for messages)."""
    return {str(key) for entries in getattr(optim, "state", {}).values() for key in entries}


def is_elementwise(name: str) -> bool:
    return name in TORCH_ELEMENTWISE or name in _registered


def check_elementwise(optimizer: Any, *, where: str, keys: Iterable[str] = (), strict: bool = True) -> None:
    """Refuse ``optimizer`` (an optimizer, its class, its class name, or ``None`` for unknown) unless it is
    elementwise; ``strict=False`` (offline tools, which only see a recorded name) refuses only names known
    to be shape-dependent. ``keys``: its state keys, named in the error."""
    if optimizer is None:
        return
    if isinstance(optimizer, str):
        name = optimizer
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = cls.__name__
    if is_elementwise(name) or (not strict and name not in SHAPE_DEPENDENT):
        return
    shown = sorted({str(k) for k in keys})
    state = f" (state keys {shown})" if shown else ""
    why = (
        "keeps state that depends on each parameter's shape"
        if name in SHAPE_DEPENDENT
        else "is not known to be elementwise (state per element or scalar, updated element by element)"
    )
    raise NotElementwiseError(
        f"{where}: {name}{state} {why}; on fairscale's flat shards such state cannot mean what it means for the "
        f"unwrapped parameters, so fsdp_optim refuses it. If {name} is elementwise, declare it with "
        f"fsdp_optim.register_elementwise_optimizer({name})"
    )
