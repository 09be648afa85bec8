"""Pure rules of a checkpoint manager's root directory: step directory names, and which steps to keep.

    root/step-00000004/   # one whole checkpoint per saved step, 8 digits (sorted by name = sorted by step)
    root/step-00000006/
    root/.step-00000002.pruning   # beside a step directory a prune is removing (written before anything is deleted)

:mod:`fsdp_optim.formats.sharded.steps` reads a root, :mod:`fsdp_optim.job.manager` saves into it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "STEP_DIGITS",
    "check_schedule",
    "parse_pruning_mark",
    "parse_step_dir",
    "pruning_mark_name",
    "step_dir_name",
    "steps_to_keep",
]

STEP_DIGITS = 8
_STEP_DIR = re.compile(rf"^step-(\d{{{STEP_DIGITS}}})$")
_PRUNING = re.compile(rf"^\.step-(\d{{{STEP_DIGITS}}})\.pruning$")


def step_dir_name(step: int) -> str:
    """``step-00000042`` for step 42; a ``ValueError`` for a step that is not an int in 0 .. 10**8 - 1."""
    if type(step) is not int or not 0 <= step < 10**STEP_DIGITS:
        raise ValueError(f"step: expected an int in 0..{10**STEP_DIGITS - 1}, found {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for (``step-00000042`` -> 42), or None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def pruning_mark_name(step: int) -> str:
    """``.step-00000042.pruning``: the mark a prune of step 42 writes beside its directory before deleting anything."""
    return f".{step_dir_name(step)}.pruning"


def parse_pruning_mark(name: str) -> int | None:
    """The step a prune's mark stands for (``.step-00000042.pruning`` -> 42), or None for any other name."""
    match = _PRUNING.match(name)
    return int(match.group(1)) if match else None


def check_schedule(every: int, keep: int, keep_every: int | None) -> None:
    """Refuse a schedule that is not positive ints (``keep_every`` may be None)."""
    for name, value in (("every", every), ("keep", keep), ("keep_every", keep_every)):
        if value is None and name == "keep_every":
            continue
        if type(value) is not int or value < 1:
            raise ValueError(f"{name}: expected a positive int, found {value!r}")


def steps_to_keep(complete: Iterable[int], *, keep: int, keep_every: int | None) -> frozenset[int]:
    """The complete steps a prune keeps: the newest ``keep``, and every one divisible by ``keep_every``.

    >>> sorted(steps_to_keep([2, 4, 6, 8, 10], keep=2, keep_every=4))
    [4, 8, 10]
    """
    ordered = sorted(set(complete))
    kept = set(ordered[-keep:]) if keep > 0 else set()
    if keep_every is not None:
        kept |= {s for s in ordered if s % keep_every == 0}
    return frozenset(kept)
