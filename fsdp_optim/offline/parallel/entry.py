"""The entry of :func:`fsdp_optim.reshard` (``parallel=True``) and of ``fsdp-optim reshard`` under ``torchrun``: the
source opened on every process, our sharded checkpoint split across the team (:mod:`.reshard`), any other source
resharded by process 0 alone (:mod:`.alone`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from fsdp_optim.core.preconditions import check_world_size
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.kinds import Kind, path_kind
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.formats.sharded.side_file import check_buffer_choice
from fsdp_optim.job.team import Team, team_of_job
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.opened.sharded import OpenedCheckpoint
from fsdp_optim.offline.parallel.alone import alone
from fsdp_optim.offline.parallel.reshard import reshard_across
from fsdp_optim.offline.sources import open_source

__all__ = ["joined_team", "reshard_in_team"]


def joined_team() -> Team:
    """This process's team (:func:`~fsdp_optim.job.team.team_of_job`); ``ValueError`` when it is on its own."""
    team = team_of_job()
    if team is None:
        raise ValueError(
            "parallel: expected a process group of 2 or more processes (torch.distributed initialized, or torchrun's "
            "RANK and WORLD_SIZE in the environment), found this process on its own; drop parallel=True"
        )
    return team


def reshard_in_team(
    team: Team | None, source: str | os.PathLike[str] | Mapping[str, Any], world_size: int,
    out_dir: str | os.PathLike[str] | Location,
    *, layout: LayoutLike | None = None, optimizer: str | None = None, allow_globals: Sequence[str] = (),
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES, overwrite: bool = False, replace_existing: bool = True,
    buffers: str = "refuse", bar: bool = False,
) -> Path:  # fmt: skip
    """:func:`fsdp_optim.reshard` by every process of ``team`` (each calls it alike; ``None``: this process's
    :func:`joined_team`); returns the manifest's path. A local output only (a directory every process sees);
    ``bar``: process 0 draws the progress bar."""
    if team is None:
        team = joined_team()
        try:
            return reshard_in_team(team, source, world_size, out_dir, layout=layout, optimizer=optimizer,
                                   allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes, overwrite=overwrite,
                                   replace_existing=replace_existing, buffers=buffers, bar=bar)  # fmt: skip
        finally:
            team.close()
    check_world_size("world_size", world_size)
    check_buffer_choice(buffers)
    place = where(out_dir)
    if not place.shared_by_processes():
        raise ValueError(f"out_dir: {out_dir} is not a local directory; a reshard by many processes writes to a "
                         "file system they share (reshard into it, then upload)")  # fmt: skip
    out = Path(os.fspath(cast("os.PathLike[str]", place)))  # a place processes share: a directory of their files
    options: dict[str, Any] = {"layout": layout, "optimizer": optimizer, "allow_globals": allow_globals,
                               "max_mapped_bytes": max_mapped_bytes, "target": True}  # fmt: skip
    if not isinstance(source, Mapping) and path_kind(source) is Kind.SHARDED:  # split: every process opens it
        with open_source(source, **options) as opened:
            assert isinstance(opened, OpenedCheckpoint), f"a sharded checkpoint opens as one, found {type(opened)}"
            return reshard_across(team, opened.checkpoint, world_size, out, given=source, overwrite=overwrite,
                                  replace_existing=replace_existing, buffers=buffers, bar=bar)  # fmt: skip

    def one() -> Path:  # any other source: process 0 alone opens it (a full dict is loaded once, not per process)
        with open_source(source, **options) as opened:
            return opened.reshard(world_size, out, layout=layout, given=source, overwrite=overwrite,
                                  replace_existing=replace_existing, buffers=buffers)  # fmt: skip

    alone(team, one, "reshard")
    return out / MANIFEST_NAME
