"""The entry of every verb a team runs (``parallel=True`` in the API, any verb under ``torchrun`` in the CLI): this
process's team (:func:`joined_team`), and the one decision whether the team splits the verb's work or process 0
runs it alone while the others wait (:func:`splits`, asked once at the verb's entry). Here too the entry of
:func:`fsdp_optim.reshard`: our sharded checkpoint split across the team (:mod:`.reshard`), any other source resharded
by process 0 alone (:func:`.shared.alone`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_optim.core.preconditions import check_world_size
from fsdp_optim.disk.location import Location, is_url, shared_directory
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.kinds import Kind, sniff_kind
from fsdp_optim.formats.sharded.locate import is_sharded_checkpoint
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.formats.sharded.side_file import check_buffer_choice
from fsdp_optim.job.team import Team, team_of_job
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.opened.sharded import OpenedCheckpoint
from fsdp_optim.offline.parallel.reshard import reshard_across
from fsdp_optim.offline.parallel.shared import alone
from fsdp_optim.offline.sources import open_source

__all__ = ["joined_team", "read_by_ranges", "reshard_in_team", "splits"]

Given = str | os.PathLike[str] | Mapping[str, Any]


def splits(verb: str, *inputs: Given, output: str | os.PathLike[str] | Location | None = None) -> bool:
    """Whether a team splits ``verb``'s work of ``inputs`` into ``output`` (each process reads, and writes, its
    share) rather than process 0 running it as one process does while the others wait
    (:func:`~fsdp_optim.offline.parallel.shared.alone`). Decided here alone, by names and first bytes, so the API and
    the CLI decide alike::

        reshard       our sharded checkpoint, into a place every process writes (a file system they share)
        consolidate   our sharded checkpoint into one safetensors file (by its name), on a file system they share
                      or as the parts of one multipart upload
        verify        our sharded checkpoint, in any location (each process reads its share by ranges)
        diff          both sides read by byte ranges (:func:`read_by_ranges`)
        anything else never
    """
    ours = all(not isinstance(given, Mapping) and is_sharded_checkpoint(given) for given in inputs)
    if verb == "verify":
        return ours
    if verb == "diff":
        return all(read_by_ranges(given) for given in inputs)
    if output is None:
        return False
    if verb == "reshard":
        return ours and shared_directory(where(output)) is not None
    if verb == "consolidate":
        return ours and Path(str(output)).suffix.lower() == ".safetensors" and _many_write(output)
    return False


def _many_write(output: str | os.PathLike[str] | Location) -> bool:
    """``output`` is one file that many processes may write: on a file system they share, or in a store that takes
    multipart uploads (each process puts its own parts)."""
    if shared_directory(where(output)) is not None:
        return True
    parent, name = str(output).rstrip("/").rsplit("/", 1)
    return where(parent).multipart(name) is not None


def read_by_ranges(given: Given) -> bool:
    """Whether ``given`` is read by byte ranges, so that each process reads only its share: a sharded checkpoint of
    ours in any location (its readers read ranges) or a local named safetensors file (by its name and first bytes;
    one at a URL is fetched whole)."""
    if isinstance(given, Mapping):
        return False
    if is_sharded_checkpoint(given):
        return True
    return not is_url(given) and Path(given).is_file() and sniff_kind(given) is Kind.NAMED


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
    team: Team | None, source: Given, world_size: int, out_dir: str | os.PathLike[str] | Location,
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
    out = shared_directory(place)  # a directory of the processes' files
    if out is None:
        raise ValueError(f"out_dir: {out_dir} is not a local directory; a reshard by many processes writes to a "
                         "file system they share (reshard into it, then upload)")  # fmt: skip
    options: dict[str, Any] = {"layout": layout, "optimizer": optimizer, "allow_globals": allow_globals,
                               "max_mapped_bytes": max_mapped_bytes, "target": True}  # fmt: skip
    if splits("reshard", source, output=place):  # every process opens it
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
