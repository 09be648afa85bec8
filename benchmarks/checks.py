"""Is a gathered dict a complete, correct full Adam state? Cheap, order-free fingerprints.

Methods number or name parameters differently (ids in unwrapped order, ids in FSDP-instance order, FQNs),
so a result is reduced to, per state key, the sorted list of ``(shape, L1 norm)`` of its tensors. Two
correct results of the same training agree up to floating-point reduction order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Fingerprint = dict[str, list[tuple[tuple[int, ...], float]]]

REL_TOL = 1e-3  # other frameworks reduce gradients in another order


def fingerprint(full: Any) -> Fingerprint:
    out: Fingerprint = {}
    for entry in full["state"].values():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                out.setdefault(key, []).append((tuple(value.shape), float(value.double().abs().sum())))
    return {key: sorted(values) for key, values in out.items()}


def compare(full: Any, reference: Fingerprint) -> str:
    """"" when ``full`` matches ``reference``; else a short reason for the table."""
    if not isinstance(full, dict) or not full.get("state"):
        return "wrong output: no state on the recipient"
    entries = list(full["state"].values())
    aliased = sum(
        1
        for e in entries
        if torch.is_tensor(e.get("exp_avg"))
        and torch.is_tensor(e.get("exp_avg_sq"))
        and (
            e["exp_avg"].untyped_storage().data_ptr() == e["exp_avg_sq"].untyped_storage().data_ptr()
            or torch.equal(e["exp_avg"], e["exp_avg_sq"])
        )
    )
    if aliased:
        return f"wrong output: exp_avg == exp_avg_sq for {aliased}/{len(entries)} params"
    mine = fingerprint(full)
    if sorted(mine) != sorted(reference):
        return f"wrong output: state keys {sorted(mine)}, expected {sorted(reference)}"
    for key, values in reference.items():
        if [s for s, _ in mine[key]] != [s for s, _ in values]:
            return f"wrong output: '{key}' shapes differ from the model's"
        for (_, a), (_, b) in zip(mine[key], values):
            if not math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12):
                return f"wrong output: '{key}' values differ (L1 {a:.6g} vs {b:.6g})"
    return ""
