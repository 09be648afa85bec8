"""What a verb hands back to :func:`fsdp_optim.cli.main` when its exit code is not simply 0: its lines and code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """Lines for stdout and the exit code (``diff``: 1 when the sources differ; ``verify``: 1 for findings)."""

    lines: tuple[str, ...]
    code: int
