"""A verb's contract with :func:`fsdp_optim.cli.main`: argument types that refuse a bad value as bad usage
(argparse's exit 2, with the verb's usage line) before any file is opened, the flags several verbs share, bad usage
that only the opened input shows (:class:`UsageError`, exit 2), and the lines and exit code a verb hands back when
its code is not simply 0 (:class:`Outcome`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Outcome", "UsageError", "allow_global", "count", "tolerance"]


@dataclass(frozen=True)
class Outcome:
    """Lines for stdout and the exit code (``diff``: 1 when the sources differ; ``verify``: 1 for findings)."""

    lines: tuple[str, ...]
    code: int


class UsageError(ValueError):
    """Bad usage that only the opened input reveals (a ``-o`` name that contradicts what this input converts to):
    printed with the verb's usage line, exit 2, as argparse does."""


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
