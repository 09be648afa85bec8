"""``verify(path, deep=True)``: beyond checksums, what a resumed run would trip on (the checks of
:mod:`fsdp_optim.core.health`), each :class:`Finding` naming the parameter and state key (or the param group and
hyperparameter); with a model layout, also every parameter's presence and shape against it. A whole checkpoint's
weights (key ``@param``), persistent buffers and the tensors of each rank's ``extra`` are checked for NaN and Inf
as the state is (a buffer that holds -inf on purpose, such as an attention mask, is reported too: the finding says
where).

Streamed: the source is planned once for one flat per parameter
(:class:`~fsdp_optim.offline.per_param.PerParameter`) and read one state tensor at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from functools import partial

from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.health import Finding, hyperparam_problems, scalar_problems, step_outliers, tensor_problems
from fsdp_optim.formats.kinds import names_shard_set
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout
from fsdp_optim.offline.per_param import PerParameter
from fsdp_optim.offline.sources import open_source
from fsdp_optim.offline.whole import BUFFER_KEY, SideState, extra_label
from fsdp_optim.offline.work import Piece, Work, run_work, state_bytes

__all__ = ["deep_findings", "deep_work"]


def deep_findings(
    path: str | os.PathLike[str], *, allow_globals: Sequence[str] = (), layout: LayoutLike | None = None
) -> tuple[Finding, ...]:
    """Every finding of the state at ``path`` (any source :func:`open_source` reads), one tensor at a time."""
    with deep_work(path, allow_globals=allow_globals, layout=layout) as work:
        return run_work(work)


@contextlib.contextmanager
def deep_work(
    path: str | os.PathLike[str], *, allow_globals: Sequence[str] = (), layout: LayoutLike | None = None
) -> Iterator[Work[Finding, tuple[Finding, ...]]]:
    """The findings of :func:`deep_findings` as a work of pieces (:mod:`fsdp_optim.offline.work`), in
    the report's order: the settings, each state tensor of each parameter (its bytes), the side files, the checks
    against ``layout``; the source stays open while the caller runs them."""
    model = resolve_layout(layout) if layout is not None else None
    shard_set = names_shard_set(path)
    with open_source(path, allow_globals=allow_globals if shard_set else ()) as opened:
        view = PerParameter.of(opened)
        pieces: list[Piece[Finding]] = [Piece(0, lambda: list(_settings(view)))]
        for name in view.names:
            for key in view.entries(name):
                pieces.append(Piece(state_bytes(view, name, key), partial(_state, view, name, key), (name, key)))
        pieces.append(Piece(0, lambda: list(_side(opened.side_state()))))
        if model is not None:
            shapes = {spec.name: spec.shape for flat in model.flat_params for spec in flat.params}
            pieces.append(Piece(0, lambda: list(_against_layout(view, shapes))))
        yield Work(pieces, tuple)


def _settings(view: PerParameter) -> Iterator[Finding]:
    """Hyperparameters out of range, and steps that disagree inside a param group."""
    for g, (hyperparams, members) in enumerate(view.groups):
        for key, problem in hyperparam_problems(hyperparams):
            yield Finding(None, key, problem, group=g)
        steps = [(name, view.entries(name)["step"].value) for name in members if "step" in view.entries(name)]
        for name, problem in step_outliers(steps):
            yield Finding(name, "step", problem, group=g)


def _state(view: PerParameter, name: str, key: str) -> list[Finding]:
    """State ``key`` of parameter ``name``: a tensor read whole (one at a time), or a scalar."""
    entry = view.entries(name)[key]
    if entry.kind is StateKind.SCALAR:
        problems = scalar_problems(key, entry.value)
    else:
        problems = tensor_problems(key, view.tensor(name, key))
    return [Finding(name, key, p) for p in problems]


def _side(side: SideState | None) -> Iterator[Finding]:
    """A whole checkpoint's buffers (each saved rank's when saved per rank, else rank 0's) and every rank's
    ``extra`` tensors: NaN or Inf values."""
    if side is None:
        return
    for r in range(side.world_size):
        buffers, extra, _ = side.parts(r)
        if side.per_rank or r == 0:
            suffix = f" (rank {r}'s)" if side.per_rank else ""
            for name, tensor in buffers.items():
                problems = tensor_problems("", tensor.reshape(-1))
                yield from (Finding(name, BUFFER_KEY, p, label=f"buffer '{name}'{suffix}") for p in problems)
        for place, tensor in extra.items():
            label = f"{extra_label(r)}, {place or 'extra'}"
            yield from (Finding(extra_label(r), place, p, label=label) for p in tensor_problems("", tensor.reshape(-1)))


def _against_layout(view: PerParameter, shapes: dict[str, tuple[int, ...]]) -> Iterator[Finding]:
    """Every parameter of the model present, of its shape; none the model lacks. Without state, a full dict does
    not know a parameter's shape: that one is checked for presence only."""
    known = view.plan.source.shapes_known
    for name, shape in shapes.items():
        if name not in view.index:
            yield Finding(name, None, "in the model's layout but not in the checkpoint")
            continue
        found = view.shape(name)
        if (known or view.entries(name)) and found != shape:
            yield Finding(name, None, f"shape {found} in the checkpoint, expected {shape} (the model's layout)")
    for name in view.names:
        if name not in shapes:
            yield Finding(name, None, "in the checkpoint but not in the model's layout")
