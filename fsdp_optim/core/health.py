"""What a resumed run would trip on in optimizer state whose bytes are intact: the checks of ``verify --deep``.

Pure: values in, one sentence per problem out (each says what was found and what was expected); the walk that
names the parameter and state key is :mod:`fsdp_optim.offline.deep`.

- any state tensor (and a whole checkpoint's weights, buffers and ``extra``'s tensors): NaN or Inf values;
- a second moment (Adam's ``exp_avg_sq`` and ``max_exp_avg_sq``, Adagrad's ``sum``, RMSprop's and Adadelta's
  ``square_avg``, Adadelta's ``acc_delta``): negative values (it is a sum of squares; the update takes its root);
- a scalar state: not finite, and ``step`` negative;
- hyperparameters: ``lr < 0``, a beta outside ``[0, 1)``, ``eps <= 0``, ``weight_decay < 0``, any of them not
  finite;
- ``step`` disagreeing between the parameters of one param group (:func:`step_outliers`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.compare import CHUNK, nonfinite_counts

__all__ = ["SECOND_MOMENTS", "hyperparam_problems", "scalar_problems", "step_outliers", "tensor_problems"]

SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta"})


@dataclass(frozen=True)
class Finding:
    """One problem: of state ``key`` of parameter ``param``, of hyperparameter ``key`` of param group ``group``,
    or of a parameter against the model's layout (presence or shape: ``key`` ``None``); ``label``, when given,
    names the place instead (a whole checkpoint's buffer, a tensor of its ``extra``)."""

    param: str | None
    key: str | None
    problem: str
    group: int | None = None
    label: str | None = None

    def __str__(self) -> str:
        if self.label is not None:
            return f"{self.label}: {self.problem}"
        where = f"param group {self.group}" if self.param is None else f"parameter '{self.param}'"
        what = "" if self.key is None else (f", '{self.key}'" if self.param is None else f", state '{self.key}'")
        return f"{where}{what}: {self.problem}"


def tensor_problems(key: str, x: torch.Tensor) -> list[str]:
    """Problems of state tensor ``key`` (1-D): non-finite values; negative values of a second moment."""
    out = []
    nan, inf = nonfinite_counts(x)
    if nan or inf:
        out.append(f"{nan} NaN and {inf} Inf values of {x.numel()}, expected every value finite")
    if key in SECOND_MOMENTS and x.numel() and x.dtype.is_floating_point and (nan or float(x.min()) < 0):
        negative = sum(int((x[s : s + CHUNK] < 0).sum()) for s in range(0, x.numel(), CHUNK))
        if negative:
            low = float(x.nan_to_num(nan=0.0).min()) if nan else float(x.min())
            out.append(
                f"{negative} negative values of {x.numel()} (min {low!r}), expected >= 0: a second moment is a "
                "running sum of squares, and the update divides by its square root"
            )
    return out


def scalar_problems(key: str, value: Any) -> list[str]:
    """Problems of a scalar state: not finite; a negative ``step``."""
    number = _number(value)
    if number is None:
        return []
    if not math.isfinite(number):
        return [f"{number!r}, expected a finite number"]
    if key == "step" and number < 0:
        return [f"{number!r}, expected a count of steps >= 0"]
    return []


_RANGES = {  # hyperparameter -> (test of a good value, what is expected)
    "lr": (lambda v: v >= 0, ">= 0"),
    "eps": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
}


def hyperparam_problems(hyperparams: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(hyperparameter, problem)`` for each value of one param group out of its range."""
    out: list[tuple[str, str]] = []
    for key, (good, expected) in _RANGES.items():
        number = _number(hyperparams.get(key))
        if number is not None and not (math.isfinite(number) and good(number)):
            out.append((key, f"{number!r}, expected a finite number {expected}"))
    betas = hyperparams.get("betas")
    if isinstance(betas, (list, tuple)):
        for i, beta in enumerate(betas):
            number = _number(beta)
            if number is not None and not 0 <= number < 1:
                out.append((f"betas[{i}]", f"{number!r}, expected 0 <= beta < 1"))
    return out


def step_outliers(steps: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
    """``(parameter, problem)`` for each parameter of one param group whose ``step`` is not the group's most
    common one (``steps``: ``(parameter, step)`` of its members, in order)."""
    counts: dict[float, list[str]] = {}
    for name, value in steps:
        number = _number(value)
        if number is not None:
            counts.setdefault(number, []).append(name)
    if len(counts) < 2:
        return []
    common = max(counts, key=lambda v: len(counts[v]))
    others = counts[common]
    shown = ", ".join(f"'{n}'" for n in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return [
        (name, f"{value!r}, but {common!r} for {len(others)} other parameters of its param group ({shown}): every "
         "parameter of a group takes the same steps, so a resumed run would bias-correct this one differently")
        for value, names in counts.items()
        if value != common
        for name in names
    ]


def _number(value: Any) -> float | None:
    """A number or one-element tensor as a float; ``None`` for anything else."""
    if torch.is_tensor(value):
        return float(value) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
