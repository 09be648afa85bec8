"""``verify --deep`` of our sharded checkpoint by a team: the files checked split by bytes
(:func:`~fsdp_optim.offline.parallel.verify.verify_across`), then, when every file is intact, the state's reading
split the same way (:func:`~fsdp_optim.offline.deep.deep_work`, each process reading its run of parameters'
state tensors once, :func:`~fsdp_optim.offline.parallel.shared.across`). The report is the one one process makes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from fsdp_optim.disk.file_check import Verification
from fsdp_optim.job.team import Team
from fsdp_optim.offline.deep import deep_work
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.parallel.shared import across
from fsdp_optim.offline.parallel.verify import verify_across

__all__ = ["verify_deep_across"]


def verify_deep_across(
    team: Team, path: str | os.PathLike[str], *, allow_globals: Sequence[str] = (), layout: LayoutLike | None = None
) -> Verification:
    """``verify(path, deep=True, layout=layout)`` split across ``team``; the whole report on every process."""
    checked = verify_across(team, path)
    if not checked.ok:  # as one process: the state is read only when every file is intact
        return replace(checked, deep=True)
    findings = across(team, deep_work(path, allow_globals=allow_globals, layout=layout), "verify --deep")
    return replace(checked, deep=True, findings=findings)
