"""``verify`` of our sharded checkpoint by a team: the files split by bytes
(:func:`~fsdp_optim.core.split.split_by_bytes`, in the manifest's order), each process reading and checking its run,
process 0 putting every verdict back in the manifest's order. The report is the one one process makes."""

from __future__ import annotations

import os
from dataclasses import replace

from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.disk.file_check import FileCheck, Verification
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.steps import verify_sharded
from fsdp_optim.job.team import Team

__all__ = ["verify_across"]


def verify_across(team: Team, path: str | os.PathLike[str]) -> Verification:
    """:func:`~fsdp_optim.formats.sharded.steps.verify_sharded` of ``path`` split across ``team``; the whole
    report on every process."""
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
    return team.from_first(merged)
