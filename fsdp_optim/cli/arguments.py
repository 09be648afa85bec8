"""Argument types that refuse a bad value as bad usage (argparse's exit 2, with the verb's usage line), before any
file is opened: a count below its least value, a negative or non-finite tolerance; and the flags several verbs share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["allow_global", "count", "tolerance"]


def count(least: int) -> Callable[[str], int]:
    """An integer of at least ``least`` (``--world-size``: 1, ``--rank``: 0)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, found {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, found {value}")
        return value

    return parse


def tolerance(text: str) -> float:
    """A finite number >= 0 (``diff --atol``/``--rtol``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, found {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, found {text}")
    return value


def allow_global(p: argparse.ArgumentParser) -> None:
    """``--allow-global``, as every verb that may read a shard set spells it."""
    p.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="MODULE.CLASS",
        help="for a fairseq/metaseq shard set: allow this class in its cfg when loading (repeatable; only for "
        "files you trust)",
    )
