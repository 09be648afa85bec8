"""Which optimizers fsdp_optim moves between layouts: elementwise ones, and why no others.

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
    "check_optimizer_name",
    "register_elementwise_optimizer",
    "state_keys",
]

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
    if name in TORCH_ELEMENTWISE or name in _registered or (not strict and name not in SHAPE_DEPENDENT):
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


# The state keys each torch.optim optimizer can keep per parameter (any subset, depending on its options).
TORCH_STATE_KEYS: dict[str, frozenset[str]] = {
    "SGD": frozenset({"momentum_buffer"}),
    "Adam": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "AdamW": frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "Adamax": frozenset({"step", "exp_avg", "exp_inf"}),
    "NAdam": frozenset({"step", "mu_product", "exp_avg", "exp_avg_sq"}),
    "RAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
    "Adagrad": frozenset({"step", "sum"}),
    "Adadelta": frozenset({"step", "square_avg", "acc_delta"}),
    "RMSprop": frozenset({"step", "square_avg", "momentum_buffer", "grad_avg"}),
    "ASGD": frozenset({"step", "eta", "mu", "ax"}),
    "Rprop": frozenset({"step", "prev", "step_size"}),
    "SparseAdam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
}
TORCH_ELEMENTWISE = frozenset(TORCH_STATE_KEYS)


def check_optimizer_name(name: str | None, keys: Iterable[str], *, where: str) -> None:
    """Refuse a class name a caller gives for state it hands over (``--optimizer``): it must be one of
    ``torch.optim``'s or a registered elementwise optimizer, and for ``torch.optim``'s the state ``keys`` found
    must be ones that optimizer keeps (Adam's ``exp_avg`` labelled ``SGD`` would load and then fail)."""
    if name is None:
        return
    if not isinstance(name, str) or not (name in TORCH_STATE_KEYS or name in _registered or name in SHAPE_DEPENDENT):
        known = ", ".join(sorted(TORCH_STATE_KEYS))
        raise ValueError(
            f"{where}: {name!r} is not an optimizer fsdp_optim knows; expected a torch.optim class name ({known}) "
            "or one declared with fsdp_optim.register_elementwise_optimizer"
        )
    check_elementwise(name, where=where, keys=keys)
    expected = TORCH_STATE_KEYS.get(name)
    found = {str(k) for k in keys}
    if expected is not None and not found <= expected:
        raise ValueError(
            f"{where}: the state holds {sorted(found)}, but {name} keeps only {sorted(expected)}; "
            f"{sorted(found - expected)} cannot be {name}'s (name the optimizer that wrote it)"
        )
