"""Which ``torch.optim`` class keeps the state of the optimizer a fairseq / metaseq checkpoint names. Pure.

fairseq and metaseq record the optimizer's wrapper class in ``optimizer_history[-1]["optimizer_name"]``
(``"FairseqAdam"``, or ``"FP16Optimizer"`` around it) and its registered name in ``cfg["optimizer"]["_name"]``
(``"adam"``; older checkpoints: ``args.optimizer``). Their optimizers are their own classes, but most keep,
per parameter, exactly the state keys of a ``torch.optim`` class, element by element:

=======================================  ===========  =========================================================
recorded as                              torch class  state
=======================================  ===========  =========================================================
``FairseqAdam``, ``MetaseqAdam``,        AdamW        ``step``, ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq``
``FairseqCPUAdam`` (``adam``,                         with amsgrad); weight decay is decoupled, as AdamW's
``cpu_adam``)
``FairseqAdamax`` (``adamax``)           Adamax       ``step``, ``exp_avg``, ``exp_inf``
``FairseqNAG`` (``nag``), ``SGD``,       SGD          ``momentum_buffer`` (NAG's is scaled by the learning rate:
``MetaseqSGDW`` (``sgd``)                             the same layout, not torch's nesterov update)
``Adagrad`` (``adagrad``)                Adagrad      torch's own class
``Adadelta`` (``adadelta``)              Adadelta     torch's own class
``FairseqAdafactor`` (``adafactor``)     refused      factored second moments: rows and columns of each matrix
``FairseqLAMB`` (``lamb``)               refused      a trust ratio per parameter tensor (its norms)
=======================================  ===========  =========================================================

The wrappers (``FP16Optimizer``, ``MemoryEfficientFP16Optimizer``, ``AMPOptimizer``, ``FairseqBMUF``) keep
the wrapped optimizer's state, named by ``cfg``. Anything else is unknown: labelled ``None`` and not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_optim.core.elementwise import check_elementwise

__all__ = ["BY_CLASS", "BY_NAME", "WRAPPERS", "last_history", "recorded_names", "torch_optimizer"]

BY_CLASS = {
    "FairseqAdam": "AdamW",
    "MetaseqAdam": "AdamW",
    "FairseqAdamW": "AdamW",
    "FairseqCPUAdam": "AdamW",
    "FairseqAdamax": "Adamax",
    "FairseqNAG": "SGD",
    "SGD": "SGD",
    "MetaseqSGDW": "SGD",
    "Adagrad": "Adagrad",
    "Adadelta": "Adadelta",
    "FairseqAdafactor": "Adafactor",
    "FairseqLAMB": "LAMB",
}
BY_NAME = {
    "adam": "AdamW",
    "adamw": "AdamW",
    "cpu_adam": "AdamW",
    "adamax": "Adamax",
    "nag": "SGD",
    "sgd": "SGD",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adafactor": "Adafactor",
    "lamb": "LAMB",
}
WRAPPERS = frozenset({"FP16Optimizer", "MemoryEfficientFP16Optimizer", "AMPOptimizer", "FairseqBMUF"})


def last_history(payload: Mapping[str, Any]) -> Mapping[str, Any]:
    """The last entry of a checkpoint's ``optimizer_history`` (``{}`` when it has none)."""
    history = payload.get("optimizer_history")
    return history[-1] if isinstance(history, list) and history and isinstance(history[-1], Mapping) else {}


def recorded_names(payload: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(class, registered name)`` as a checkpoint records them; ``None`` where it does not."""
    recorded = last_history(payload).get("optimizer_name")
    cfg = payload.get("cfg")
    optimizer = cfg.get("optimizer") if isinstance(cfg, Mapping) else None
    name = optimizer.get("_name") if isinstance(optimizer, Mapping) else None
    legacy = getattr(payload.get("args"), "optimizer", None)  # checkpoints written before fairseq's hydra configs
    if name is None and isinstance(legacy, str):
        name = legacy
    return (recorded if isinstance(recorded, str) else None, name if isinstance(name, str) else None)


def torch_optimizer(recorded: str | None, name: str | None, *, where: str) -> str | None:
    """The ``torch.optim`` class whose state the recorded optimizer keeps, ``None`` when unknown.

    Raises :class:`~fsdp_optim.core.elementwise.NotElementwiseError` for an optimizer whose state depends on
    parameter shapes (Adafactor, LAMB): on fairscale's flat shards it cannot be moved between world sizes.
    """
    if recorded is not None and recorded not in WRAPPERS:
        target = BY_CLASS.get(recorded)
    else:
        target = BY_NAME.get(name) if name is not None else None
    if target is None:
        return None
    shown = " / ".join(n for n in (recorded, name) if n)
    check_elementwise(target, where=f"{where}: the optimizer ({shown})")
    return target
