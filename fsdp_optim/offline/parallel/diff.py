"""``diff`` by a team: when both sources are read by byte ranges (a sharded checkpoint of ours, a local named
safetensors file: :func:`~fsdp_optim.offline.parallel.entry.splits`), the comparison's pieces
(:func:`~fsdp_optim.offline.diff.diff_work`: a parameter's state key at a time, weighing its bytes on both sides)
are split by bytes across the processes, each reading its run once
(:func:`~fsdp_optim.offline.parallel.shared.across`). Any other pair (a full dict or a shard set is loaded whole:
every process would read all of it) is compared by process 0 while the others wait
(:func:`~fsdp_optim.offline.parallel.shared.alone`). Every process returns the report one process makes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from fsdp_optim.offline.diff_report import DiffReport, DiffRow
from fsdp_optim.offline.parallel.entry import joined_team, splits
from fsdp_optim.offline.parallel.shared import across, alone
from fsdp_optim.offline.work import Work, run_work

__all__ = ["diff_in_team"]


def diff_in_team(
    a: str | os.PathLike[str] | Mapping[str, Any], b: str | os.PathLike[str] | Mapping[str, Any],
    opening: AbstractContextManager[Work[DiffRow, DiffReport]],
) -> DiffReport:  # fmt: skip
    """The report of ``opening`` (:func:`~fsdp_optim.offline.diff.diff_work` of ``a`` and ``b``) by this process's
    team (:func:`~fsdp_optim.offline.parallel.entry.joined_team`), on every process."""
    team = joined_team()
    try:
        if splits("diff", a, b):
            return across(team, opening, "diff")

        def whole() -> DiffReport:
            with opening as work:
                return run_work(work)

        report: DiffReport = team.from_first(alone(team, whole, "diff"))
        return report
    finally:
        team.close()
