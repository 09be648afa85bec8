"""What a verb hands back to :func:`fsdp_optim.cli.main` when its exit code is not simply 0: its lines and code; or
raises when its usage is wrong in a way only its opened input shows (:class:`UsageError`, exit 2)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """Lines for stdout and the exit code (``diff``: 1 when the sources differ; ``verify``: 1 for findings)."""

    lines: tuple[str, ...]
    code: int


class UsageError(ValueError):
    """Bad usage that only the opened input reveals (a ``-o`` name that contradicts what this input converts to):
    :func:`fsdp_optim.cli.main` prints it with the verb's usage line and exits 2, as argparse does."""
