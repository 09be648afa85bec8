"""``verify`` of our sharded checkpoint by a team: the files split by bytes
(:func:`~fsdp_optim.core.split.split_by_bytes`, in the manifest's order), each process reading and checking its run,
process 0 putting every verdict back in the manifest's order. ``--deep``: then, when every file is intact, the state's
reading split the same way (:func:`~fsdp_optim.offline.deep.deep_work`, each process reading its run of parameters'
state tensors once, :func:`~fsdp_optim.offline.parallel.shared.across`). The report is the one one process makes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.disk.file_check import FileCheck, Verification
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.steps import verify_sharded
from fsdp_optim.job.team import Team
from fsdp_optim.offline.deep import deep_work
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.parallel.shared import across

__all__ = ["verify_across"]


def verify_across(
    team: Team, path: str | os.PathLike[str], *, deep: bool = False, allow_globals: Sequence[str] = (),
    layout: LayoutLike | None = None,
) -> Verification:  # fmt: skip
    """``verify(path, deep=deep, layout=layout)`` split across ``team`` (the module docstring); the whole report on
    every process."""
    manifest = open_checkpoint(path).manifest
    files = [*manifest.files, *(manifest.training.files if manifest.training is not None else ())]
    split = split_by_bytes([f.nbytes for f in files], team.size)
    mine = {files[i].file for i in split.runs[team.rank]}
    watch = team.progress(sum(f.nbytes for f in files))
    with team.step("verify failed on another process", watch=watch):
        report = verify_sharded(path, only=mine.__contains__)
        watch.advance(sum(f.nbytes for f in files if f.file in mine))
    gathered = team.to_first(report.files[1:])  # each process's checks but the manifest's (process 0 keeps its own)
    merged = None
    if gathered is not None:
        order = {f.file: k for k, f in enumerate(files)}
        checks: list[FileCheck] = sorted((c for share in gathered for c in share), key=lambda c: order[c.path.name])
        merged = replace(report, files=(report.files[0], *checks))
    checked: Verification = team.from_first(merged)
    if not deep or not checked.ok:  # as one process: the state is read only when every file is intact
        return replace(checked, deep=deep)
    findings = across(team, deep_work(path, allow_globals=allow_globals, layout=layout), "verify --deep")
    return replace(checked, deep=True, findings=findings)
