"""An opened source seen parameter by parameter: planned once against one flat per parameter
(:func:`~fsdp_optim.core.plan.per_parameter`), each ``(parameter, state key)`` tensor made when asked, one at a
time, from a restricted plan (:func:`~fsdp_optim.core.execute.restrict`), as the DCP and safetensors exports do.

``diff`` and ``verify --deep`` walk sources this way, so their memory is one state tensor per source, whatever
the size of the state::

    view = PerParameter.of(opened)
    view.names                      ("embed.weight", ..., "block2.inner.b.bias")  the source's parameter order
    view.entries("embed.weight")    {"exp_avg": StateEntry(sharded, float32), "step": StateEntry(scalar, 2.0)}
    view.tensor("embed.weight", "exp_avg")   -> a new flat tensor of 66 elements (the file mapping trimmed after)
    view.groups                     ((hyperparameters, ("embed.weight", ...)), ...)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.execute import assemble_full, restrict
from fsdp_optim.core.plan import per_parameter, plan
from fsdp_optim.core.records import StateEntry
from fsdp_optim.core.source import Plan
from fsdp_optim.formats.kinds import Kind
from fsdp_optim.offline.opened.base import Opened

__all__ = ["PerParameter"]


@dataclass(frozen=True)
class PerParameter:
    """An opened source planned for one flat per parameter (see the module docstring)."""

    label: str
    kind: str
    optimizer: str | None
    plan: Plan
    names: tuple[str, ...]  # every parameter the source names, in its order
    index: Mapping[str, int]  # parameter name -> target flat of the plan
    groups: tuple[tuple[Mapping[str, Any], tuple[str, ...]], ...]  # (hyperparameters, member names) per group
    trim: Callable[[], None]

    @classmethod
    def of(cls, opened: Opened) -> PerParameter:
        """Plan ``opened`` once (a whole checkpoint's weights as one more state key per parameter, ``@param``:
        compared and checked too); ``ValueError`` for a kind that holds no optimizer state."""
        source = opened.whole_source() or opened.source
        if source is None:
            raise ValueError(f"{opened.label}: a {opened.kind.value} holds no optimizer state")
        order = opened.order or tuple(spec.name for flat in source.flats for spec in flat.params)
        the_plan = plan(source, per_parameter(source, order))
        flat_names = [flat.params[0].name for flat in the_plan.target.flat_params]
        index = {name: t for t, name in enumerate(flat_names)}
        rank = {name: i for i, name in enumerate(order)}
        groups = tuple(
            (g.hyperparams, tuple(sorted((flat_names[t] for t in g.flat_indices), key=lambda n: rank.get(n, 0))))
            for g in the_plan.groups
        )
        names = tuple(order) + tuple(n for n in flat_names if n not in rank)
        whole = opened.is_whole() and opened.kind not in (Kind.WHOLE_FILE, Kind.HF)  # (their names say so)
        kind = f"whole {opened.kind.value} (model, optimizer, extra)" if whole else opened.kind.value
        return cls(opened.label, kind, source.optimizer, the_plan, names, index, groups, opened.trim)

    def entries(self, name: str) -> dict[str, StateEntry]:
        """The state entries of parameter ``name`` by key (empty: no state)."""
        t = self.index.get(name)
        flat_plan = self.plan.flats.get(t) if t is not None else None
        return {e.key: e for e in flat_plan.entries} if flat_plan is not None else {}

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Parameter ``name``'s shape as the source records it (``None``: the source does not name it)."""
        t = self.index.get(name)
        return None if t is None else self.plan.target.flat_params[t].params[0].shape

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """State ``key`` of parameter ``name`` as a new flat tensor (``numel`` elements); file mappings are
        trimmed after it is read."""
        t = self.index[name]
        try:
            return assemble_full(restrict(self.plan, t, key))[t][key]
        finally:
            self.trim()
