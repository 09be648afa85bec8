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


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor (FSDP2): its local shard
    return local.untyped_storage().data_ptr()


def storages(optim: torch.optim.Optimizer) -> frozenset[int]:
    """Data pointers of the live optimizer's state tensors."""
    return frozenset(_storage(v) for s in optim.state.values() for v in s.values() if torch.is_tensor(v))


def compare(full: Any, reference: Fingerprint | None, live: frozenset[int] = frozenset()) -> str:
    """ "" when ``full`` matches ``reference``; else a short reason for the table.

    Reasons starting with "wrong output" mean the dict is not the full state; "returns the live
    optimizer's own tensors" means it is, but those entries cost no memory and change with training.
    """
    if not isinstance(full, dict) or not full.get("state"):
        return "wrong output: no state on the recipient"
    entries = list(full["state"].values())
    aliased = sum(
        1
        for e in entries
        if torch.is_tensor(e.get("exp_avg"))
        and torch.is_tensor(e.get("exp_avg_sq"))
        and (_storage(e["exp_avg"]) == _storage(e["exp_avg_sq"]) or torch.equal(e["exp_avg"], e["exp_avg_sq"]))
    )
    if aliased:
        return f"wrong output: exp_avg == exp_avg_sq for {aliased}/{len(entries)} params"
    mismatch = _mismatch(fingerprint(full), reference) if reference is not None else ""
    if mismatch:
        return f"wrong output: {mismatch}"
    shared: dict[str, int] = {}
    for entry in entries:
        for key, value in entry.items():
            if torch.is_tensor(value) and _storage(value) in live:
                shared[key] = shared.get(key, 0) + 1
    if shared:
        detail = ", ".join(f"'{k}' of {n} params" for k, n in sorted(shared.items()))
        return f"returns the live optimizer's own tensors (no copy): {detail}"
    return ""


def _mismatch(mine: Fingerprint, reference: Fingerprint) -> str:
    if sorted(mine) != sorted(reference):
        return f"state keys {sorted(mine)}, expected {sorted(reference)}"
    for key, values in reference.items():
        if [s for s, _ in mine[key]] != [s for s, _ in values]:
            return f"'{key}' shapes differ from the model's"
        for (_, a), (_, b) in zip(mine[key], values):
            if not math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12):
                return f"'{key}' values differ (L1 {a:.6g} vs {b:.6g})"
    return ""
