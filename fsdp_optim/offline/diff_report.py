"""What :func:`fsdp_optim.diff` returns: a frozen :class:`DiffReport` of per-(parameter, state key) rows, the
differences of settings (hyperparameters, param groups, optimizer), and a :class:`DiffSummary`.

A row's ``status``:

    equal             bit for bit
    within tolerance  not bitwise, but every element within atol + rtol * |b| (only when a tolerance is given)
    different         values differ (beyond the tolerance)
    only in a/b       the parameter, or its state key, is in one source only
    shape differs     the parameter's shape differs (its state is not compared)
    kind differs      a scalar on one side, a tensor on the other
    not compared      a part one side holds that the other cannot hold or did not keep (a saved rank's ``extra``
                      when the two saved different numbers of ranks, or a layout keeps none): ``detail`` says why

``DiffReport.to_json()`` is the record as JSON values: floats that are not finite are the strings ``"inf"``
and ``"nan"``, so that the output is strict JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["EQUAL", "NOT_COMPARED", "WITHIN", "DiffReport", "DiffRow", "DiffSummary", "SettingDiff", "diff_summary"]

EQUAL, WITHIN, DIFFERENT = "equal", "within tolerance", "different"
ONLY_A, ONLY_B, SHAPE, KIND = "only in a", "only in b", "shape differs", "kind differs"
NOT_COMPARED = "not compared"  # never "equal": the report is not equal while any part is not compared


@dataclass(frozen=True)
class DiffRow:
    """One ``(param, key)`` of either source; ``key`` is ``None`` for a parameter present on one side only.

    Counts and errors are of the elements compared (0 where nothing was); ``max_ulp`` is ``None`` when the
    values are not floats of one dtype."""

    param: str
    key: str | None
    status: str
    numel: int = 0
    dtype_a: str | None = None
    dtype_b: str | None = None
    bitwise_equal: bool = False
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int | None = None
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    scalar: bool = False  # a scalar state (step, ...): ``numel`` 1
    detail: str = ""  # a scalar's two values, or two shapes

    @property
    def same(self) -> bool:
        return self.status in (EQUAL, WITHIN)


@dataclass(frozen=True)
class SettingDiff:
    """A setting that differs: a hyperparameter of param group ``group``, its members (``key`` ``"params"``),
    the number of groups (``"param_groups"``, ``group`` ``None``) or the optimizer's class (``"optimizer"``)."""

    group: int | None
    key: str
    a: str
    b: str


@dataclass(frozen=True)
class DiffSummary:
    params_a: int
    params_b: int
    tensors: int  # (param, state key) tensors compared on both sides
    tensors_equal: int  # of those, bit for bit
    scalars: int  # scalar states compared on both sides
    rows_different: int  # rows whose status is neither equal nor within tolerance (not compared ones included)
    settings_different: int
    not_compared: int  # rows of parts that could not be compared (each says why)
    max_abs: float
    max_rel: float
    max_ulp: int
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int


@dataclass(frozen=True)
class DiffReport:
    """Two sources compared (see the module docstring); ``equal``: within ``atol``/``rtol`` everywhere (bit for
    bit when both are 0), no setting differs and no part went uncompared."""

    a: str
    b: str
    kind_a: str
    kind_b: str
    atol: float
    rtol: float
    rows: tuple[DiffRow, ...]
    settings: tuple[SettingDiff, ...]
    summary: DiffSummary

    @property
    def equal(self) -> bool:
        return self.summary.rows_different == 0 and self.summary.settings_different == 0

    @property
    def differences(self) -> tuple[DiffRow, ...]:
        return tuple(r for r in self.rows if not r.same)

    def to_json(self) -> dict[str, Any]:
        """The record as strict JSON values (non-finite floats as ``"inf"`` / ``"nan"``)."""
        return _json_safe({**asdict(self), "equal": self.equal})


def diff_summary(
    rows: tuple[DiffRow, ...], settings: tuple[SettingDiff, ...], params_a: int, params_b: int
) -> DiffSummary:
    compared = [r for r in rows if r.status in (EQUAL, WITHIN, DIFFERENT)]
    tensors = [r for r in compared if not r.scalar]
    return DiffSummary(
        params_a=params_a,
        params_b=params_b,
        tensors=len(tensors),
        tensors_equal=sum(r.bitwise_equal for r in tensors),
        scalars=len(compared) - len(tensors),
        rows_different=sum(not r.same for r in rows),
        settings_different=len(settings),
        not_compared=sum(r.status == NOT_COMPARED for r in rows),
        max_abs=max((r.max_abs for r in compared), default=0.0),
        max_rel=max((r.max_rel for r in compared), default=0.0),
        max_ulp=max((r.max_ulp or 0 for r in compared), default=0),
        nan_a=sum(r.nan_a for r in rows),
        nan_b=sum(r.nan_b for r in rows),
        inf_a=sum(r.inf_a for r in rows),
        inf_b=sum(r.inf_b for r in rows),
    )


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
