"""``diff``: two sources of the same model's optimizer state compared per parameter and state key, whatever
their world sizes, nesting and formats (any kind :func:`~fsdp_optim.offline.sources.open_source` reads: a
sharded checkpoint of any version, a full dict or its file, a named safetensors file, a fairseq/metaseq shard
set).

Streaming: each source is planned once for one flat per parameter
(:class:`~fsdp_optim.offline.per_param.PerParameter`); then, parameter by parameter and key by key, one tensor of
``a`` and one of ``b`` are made, compared (:func:`~fsdp_optim.core.compare.compare_tensors`) and dropped. Memory
is two state tensors of one parameter, never either whole state.

What is compared (each difference a row or a setting of :class:`~fsdp_optim.offline.diff_report.DiffReport`):
parameters and state keys present on one side only; shapes; tensors (bitwise, max abs / rel error, max ULP
distance, NaN and Inf counts); scalar states (``step``, ...); the optimizer's class, the number of param groups,
every hyperparameter of each group and each group's members. A whole checkpoint (``save_checkpoint``) adds its
model: the weights, as one more key per parameter (``@param``), and the persistent buffers (key ``@buffer``; per
saved rank, ``@buffer of rank r``, when either side saved them per rank), and two whole checkpoints are compared on
the tensors of each rank's ``extra`` too (rows ``extra of rank r``, for the ranks both hold). Against an
optimizer-only source, the whole checkpoint's weights and buffers are rows on its side only, so the verdict is
"different", never "equal": the other side does not hold them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeGuard

import torch

from fsdp_optim.core.compare import compare_tensors
from fsdp_optim.core.flatten import StateKind, same_scalar, show_value
from fsdp_optim.core.records import StateEntry
from fsdp_optim.formats.kinds import Given, names_shard_set
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.offline.diff_report import (
    DIFFERENT,
    EQUAL,
    KIND,
    NOT_COMPARED,
    ONLY_A,
    ONLY_B,
    SHAPE,
    WITHIN,
    DiffReport,
    DiffRow,
    SettingDiff,
    diff_summary,
)
from fsdp_optim.offline.per_param import PerParameter
from fsdp_optim.offline.sources import open_source
from fsdp_optim.offline.whole import BUFFER_KEY, SideState, extra_label
from fsdp_optim.offline.work import Piece, Work, run_work, state_bytes

__all__ = ["diff", "diff_work"]


def diff(
    a: Given,
    b: Given,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    allow_globals: Sequence[str] = (),
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    parallel: bool = False,
) -> DiffReport:
    """Compare the optimizer state of ``a`` with ``b`` (see the module docstring); nothing is written.

    Args:
        a, b: any source: a path (sharded checkpoint directory or manifest, full dict file, named safetensors
            file, fairseq/metaseq shard set) or a full dict.
        atol, rtol: two tensors are the same when ``|a - b| <= atol + rtol * |b|`` everywhere; both 0 (the
            default): only when they are equal bit for bit.
        allow_globals: for a shard set, classes its ``cfg`` may hold.
        parallel: every process of the process group (or torchrun's) calls it alike, and each returns the report.
            When both sources are read by ranges (a local sharded checkpoint of ours, a named safetensors file), the
            comparison is split by bytes across the processes, each reading its run of parameters once
            (:mod:`fsdp_optim.offline.parallel.diff`); any other pair is compared by process 0 while the others wait.

    Returns a :class:`~fsdp_optim.offline.diff_report.DiffReport`; ``report.equal`` is the verdict. Raises
    ``ValueError`` / ``FileNotFoundError`` for an input that is not a source, as the readers do.
    """
    for name, value in (("atol", atol), ("rtol", rtol)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == math.inf:
            raise ValueError(f"{name}: expected a finite number >= 0, found {value!r}")
    opening = diff_work(a, b, atol=float(atol), rtol=float(rtol), allow_globals=allow_globals,
                        max_mapped_bytes=max_mapped_bytes)  # fmt: skip
    if parallel:
        from fsdp_optim.offline.parallel.diff import diff_in_team

        return diff_in_team(a, b, opening)
    with opening as work:
        return run_work(work)


@contextlib.contextmanager
def diff_work(
    a: Given, b: Given, *, atol: float, rtol: float, allow_globals: Sequence[str], max_mapped_bytes: int
) -> Iterator[Work[DiffRow, DiffReport]]:
    """:func:`diff` as a work of pieces (:mod:`fsdp_optim.offline.work`), in the report's order: each
    state of each parameter of ``a`` (a tensor weighs its bytes on both sides), those only ``b`` has, the side
    files; the settings are compared before any piece runs. Both sources stay open while the caller runs them."""
    with contextlib.ExitStack() as stack:
        opened = []
        for given in (a, b):
            globals_ = allow_globals if names_shard_set(given) else ()
            opened.append(
                stack.enter_context(open_source(given, allow_globals=globals_, max_mapped_bytes=max_mapped_bytes))
            )
        va, vb = (PerParameter.of(o) for o in opened)  # a whole checkpoint's weights: one more key, "@param"
        pieces = [*_row_pieces(va, vb, atol, rtol)]
        pieces.append(Piece(0, lambda: list(_side_rows(opened[0].side_state(), opened[1].side_state(), atol, rtol))))
        settings = tuple(_settings(va, vb))
        counts = len(va.names), len(vb.names)

        def report(rows: tuple[DiffRow, ...]) -> DiffReport:
            summary = diff_summary(rows, settings, *counts)
            return DiffReport(va.label, vb.label, va.kind, vb.kind, atol, rtol, rows, settings, summary)

        yield Work(pieces, report)


def _row_pieces(va: PerParameter, vb: PerParameter, atol: float, rtol: float) -> Iterator[Piece[DiffRow]]:
    """Every parameter of ``a`` in its order (a piece per state key), then those only ``b`` has."""
    in_a, in_b = set(va.names), set(vb.names)
    for name in va.names:
        if name in in_b:
            yield from _param_pieces(name, va, vb, atol, rtol)
        else:
            yield Piece(0, partial(list, (DiffRow(name, None, ONLY_A),)))
    only_b = [DiffRow(name, None, ONLY_B) for name in vb.names if name not in in_a]
    yield Piece(0, partial(list, only_b))


def _param_pieces(name: str, va: PerParameter, vb: PerParameter, atol: float, rtol: float) -> Iterator[Piece[DiffRow]]:
    ea, eb = va.entries(name), vb.entries(name)
    shape_a, shape_b = va.shape(name), vb.shape(name)
    # Without state a full dict does not know a parameter's shape, so shapes are compared where both know them.
    known = (ea and eb) or (va.plan.source.shapes_known and vb.plan.source.shapes_known)
    if known and shape_a != shape_b:
        yield Piece(0, partial(list, [DiffRow(name, None, SHAPE, detail=f"{shape_a} in a, {shape_b} in b")]))
        return
    for key in [*ea, *(k for k in eb if k not in ea)]:
        if key not in eb:
            yield Piece(0, partial(list, [DiffRow(name, key, ONLY_A)]))
        elif key not in ea:
            yield Piece(0, partial(list, [DiffRow(name, key, ONLY_B)]))
        else:
            nbytes = state_bytes(va, name, key) + state_bytes(vb, name, key)
            yield Piece(nbytes, partial(_entry_rows, name, key, ea[key], eb[key], va, vb, atol, rtol), (name, key))


def _entry_rows(
    name: str, key: str, ea: StateEntry, eb: StateEntry, va: PerParameter, vb: PerParameter, atol: float, rtol: float
) -> list[DiffRow]:
    if ea.kind is not eb.kind:
        shown = {StateKind.SCALAR: "a scalar", StateKind.SHARDED: "a tensor"}
        return [DiffRow(name, key, KIND, detail=f"{shown[ea.kind]} in a, {shown[eb.kind]} in b")]
    if ea.kind is StateKind.SCALAR:
        return [_scalar_row(name, key, ea.value, eb.value, atol, rtol)]
    return [_tensor_row(name, key, va.tensor(name, key), vb.tensor(name, key), atol, rtol)]


def _tensor_row(param: str, key: str, ta: torch.Tensor, tb: torch.Tensor, atol: float, rtol: float) -> DiffRow:
    """Two tensors of one place compared (their shapes first: a buffer's or ``extra``'s keep theirs)."""
    if ta.shape != tb.shape:
        return DiffRow(param, key, SHAPE, detail=f"{tuple(ta.shape)} in a, {tuple(tb.shape)} in b")
    stats = compare_tensors(ta.reshape(-1), tb.reshape(-1), atol=atol, rtol=rtol)
    status = _status(stats.bitwise_equal, stats.close, atol, rtol)
    return DiffRow(
        param, key, status, stats.numel, _dtype_name(ta), _dtype_name(tb), stats.bitwise_equal, stats.max_abs,
        stats.max_rel, stats.max_ulp, stats.nan_a, stats.nan_b, stats.inf_a, stats.inf_b,
    )


def _side_rows(sa: SideState | None, sb: SideState | None, atol: float, rtol: float) -> Iterator[DiffRow]:
    """The buffers and each saved rank's ``extra`` (its tensors, then its other values), one saved rank at a time.
    A part one side holds and the other does not (a source without a model, a rank only one side saved, a layout
    that keeps no ``extra``) is a row of that side only, saying why: never left out in silence."""
    if sa is None or sb is None:
        yield from _model_alone(sa, sb)
        return
    per_rank = sa.per_rank or sb.per_rank
    both = min(sa.world_size, sb.world_size)
    for r in range(max(sa.world_size, sb.world_size)):
        if r >= both and not per_rank:  # rank 0's buffers are everyone's; this rank's extra is on one side only
            yield _extra_alone(r, sa, sb)
            continue
        buffers_a, extra_a, values_a = sa.parts(r) if r < sa.world_size else ({}, {}, None)
        buffers_b, extra_b, values_b = sb.parts(r) if r < sb.world_size else ({}, {}, None)
        if per_rank or r == 0:
            key = f"{BUFFER_KEY} of rank {r}" if per_rank else BUFFER_KEY
            yield from _pairs(buffers_a, buffers_b, atol, rtol, key=key)
        if not (sa.holds_extra or sb.holds_extra):  # neither keeps one (two Hugging Face layouts)
            continue
        if r >= both or not (sa.holds_extra and sb.holds_extra):
            yield _extra_alone(r, sa, sb)
            continue
        yield from _pairs(extra_a, extra_b, atol, rtol, param=extra_label(r))
        same = _same_values(values_a, values_b)
        detail = "" if same else f"{show_value(values_a)[:80]} in a, {show_value(values_b)[:80]} in b"
        yield DiffRow(extra_label(r), "values", EQUAL if same else DIFFERENT, 1, bitwise_equal=same, scalar=True,
                      detail=detail)  # fmt: skip


def _model_alone(sa: SideState | None, sb: SideState | None) -> Iterator[DiffRow]:
    """The buffers and ``extra`` of the one side that holds a model: rows of that side only."""
    one, status, other = (sa, ONLY_A, "b") if sa is not None else (sb, ONLY_B, "a")
    if one is None:
        return
    for name in one.buffer_names:
        yield DiffRow(name, BUFFER_KEY, status, detail=f"a whole checkpoint's buffer; {other} has no model")
    for r in range(one.world_size if one.holds_extra else 0):
        side = "a" if status == ONLY_A else "b"
        yield DiffRow(extra_label(r), None, NOT_COMPARED, detail=f"only {side} holds it; {other} has no model")


def _extra_alone(r: int, sa: SideState, sb: SideState) -> DiffRow:
    """Saved rank ``r``'s ``extra``, which one side holds and the other does not: why, as its row says."""
    in_a = r < sa.world_size and sa.holds_extra
    other = sb if in_a else sa
    why = ("its layout keeps no extra" if not other.holds_extra else
           f"it holds the extra of {other.world_size} saved rank(s)")  # fmt: skip
    return DiffRow(extra_label(r), None, NOT_COMPARED, detail=f"only {'a' if in_a else 'b'} holds it; "
                                                              f"{'b' if in_a else 'a'}: {why}")


def _same_values(x: object, y: object) -> bool:
    """``extra``'s values as a resumed run reads them: one structure (a tuple is no list), numbers bit for bit."""
    if isinstance(x, dict) and isinstance(y, dict):
        return list(x) == list(y) and all(_same_values(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same_values(p, q) for p, q in zip(x, y))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and bool(x == y)


def _pairs(
    ta: dict[str, torch.Tensor], tb: dict[str, torch.Tensor], atol: float, rtol: float, *, key: str = "",
    param: str | None = None,
) -> Iterator[DiffRow]:
    """A row per name of ``ta`` (in its order), then per name only ``tb`` holds: buffers (the name is the row's
    parameter, ``key`` its key) or ``extra``'s tensors (``param`` given: the name, a place in the tree, is the key)."""
    for name in [*ta, *(n for n in tb if n not in ta)]:
        row_param, row_key = (name, key) if param is None else (param, name or "extra")
        if name not in tb:
            yield DiffRow(row_param, row_key, ONLY_A)
        elif name not in ta:
            yield DiffRow(row_param, row_key, ONLY_B)
        else:
            yield _tensor_row(row_param, row_key, ta[name], tb[name], atol, rtol)


def _status(bitwise: bool, close: bool, atol: float, rtol: float) -> str:
    if bitwise:
        return EQUAL
    return WITHIN if close and (atol > 0 or rtol > 0) else DIFFERENT


def _scalar_row(name: str, key: str, x: object, y: object, atol: float, rtol: float) -> DiffRow:
    """A scalar state (``step``, ...): bit for bit means one type, dtype and bit pattern (:func:`same_scalar`)."""
    bitwise = same_scalar(x, y)
    detail = "" if bitwise else f"{show_value(x)} in a, {show_value(y)} in b"
    tx, ty = _as_tensor(x), _as_tensor(y)
    dtype_a, dtype_b = _dtype_name(x), _dtype_name(y)
    if tx is None or ty is None:
        return DiffRow(name, key, EQUAL if bitwise else DIFFERENT, 1, dtype_a, dtype_b, bitwise, scalar=True,
                       detail=detail)
    stats = compare_tensors(tx, ty, atol=atol, rtol=rtol)
    return DiffRow(
        name, key, _status(bitwise, stats.close, atol, rtol), 1, dtype_a, dtype_b, bitwise, stats.max_abs,
        stats.max_rel, stats.max_ulp, stats.nan_a, stats.nan_b, stats.inf_a, stats.inf_b, scalar=True, detail=detail,
    )


def _as_tensor(value: object) -> torch.Tensor | None:
    """A number or 0-dim tensor as a 1-element tensor (``None`` for anything else)."""
    if torch.is_tensor(value) and value.numel() == 1:
        return value.detach().reshape(1).cpu()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor([value], dtype=torch.float64 if isinstance(value, float) else torch.int64)
    return None


def _dtype_name(value: object) -> str:
    return str(value.dtype).removeprefix("torch.") if torch.is_tensor(value) else type(value).__name__


def _settings(va: PerParameter, vb: PerParameter) -> Iterator[SettingDiff]:
    """The optimizer's class, the number of param groups, and per group its hyperparameters and members."""
    if va.optimizer and vb.optimizer and va.optimizer != vb.optimizer:
        yield SettingDiff(None, "optimizer", va.optimizer, vb.optimizer)
    if len(va.groups) != len(vb.groups):
        yield SettingDiff(None, "param_groups", f"{len(va.groups)} groups", f"{len(vb.groups)} groups")
    for g, ((ha, ma), (hb, mb)) in enumerate(zip(va.groups, vb.groups)):
        for key in [*ha, *(k for k in hb if k not in ha)]:
            if key not in ha or key not in hb or not _same_setting(ha[key], hb[key]):
                yield SettingDiff(g, key, _shown(ha, key), _shown(hb, key))
        if set(ma) != set(mb):
            first = sorted(set(ma) ^ set(mb))[0]
            side = "a" if first in ma else "b"
            yield SettingDiff(g, "params", f"{len(ma)} params", f"{len(mb)} params ('{first}' only in {side})")


def _shown(hyperparams: Mapping[str, Any], key: str) -> str:
    return show_value(hyperparams[key]) if key in hyperparams else "absent"


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same_setting(x: object, y: object) -> bool:
    """Hyperparameters as a resumed run sees them: ``(0.9, 0.999)`` and ``[0.9, 0.999]`` alike, ``0`` and
    ``0.0`` alike, floats otherwise exactly; tensors bit for bit."""
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_setting(p, q) for p, q in zip(x, y))
    if torch.is_tensor(x) or torch.is_tensor(y):
        return same_scalar(x, y)
    if _is_number(x) and _is_number(y):
        return bool(x == y) or (math.isnan(x) and math.isnan(y))
    return type(x) is type(y) and bool(x == y)
