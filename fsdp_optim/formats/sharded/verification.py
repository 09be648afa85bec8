"""Verifying our sharded checkpoint end to end, changing nothing: the manifest (its own checksum), then per rank
file: present, of the manifest's size, its header's checksum the manifest's, every byte of state against its
checksum (format 2 and 3: every chunk's; format 1: every zip record's CRC-32 and every unit's digest); and, in a
whole checkpoint, every side file: present, of its size, its bytes against the manifest's digest. Each file is read
once, into memory, and released. :func:`fsdp_optim.verify` calls this for a sharded checkpoint; the checkpoint
manager (:mod:`fsdp_optim.job.manager`) and ``fsdp-optim list`` call it for each step directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from fsdp_optim.disk.errors import StoreUnavailable
from fsdp_optim.disk.file_check import FileCheck, Verification, check_file
from fsdp_optim.disk.location import Location, public
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.locate import checkpoint_dir
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.side_file import read_side_file
from fsdp_optim.formats.sharded.writer import leftovers

__all__ = ["LEFTOVER", "present_and_sized", "verify_sharded"]

LEFTOVER = "leftover of an interrupted save"  # how verify names such a file (the CLI counts them apart)


def verify_sharded(path: str | os.PathLike[str] | Location, only: Callable[[str], bool] | None = None) -> Verification:
    """One :class:`FileCheck` per file of the checkpoint at ``path`` (its directory or manifest); never raises for
    damage (an unreadable manifest is the manifest's failed check). ``only``: the names of the files to check (the
    manifest is checked always; a process's share when many verify one checkpoint)."""
    directory = checkpoint_dir(path)
    manifest_path = directory / MANIFEST_NAME
    try:
        ckpt = open_checkpoint(path)
    except StoreUnavailable:
        raise  # the store did not answer: not damage (a manager must not skip a good step for an outage)
    except (ValueError, OSError) as exc:
        detail = str(exc).removeprefix(f"{manifest_path}: ")
        return Verification(public(directory), "sharded checkpoint", (FileCheck(manifest_path, False, detail),))
    manifest = ckpt.manifest
    side_files = manifest.training.files if manifest.training is not None else ()
    listed = f"{len(manifest.files)} rank files" + (f" and {len(side_files)} side files" if side_files else "")
    checks = [FileCheck(manifest_path, True, f"ok: manifest of {listed}, checksum matches")]
    with ckpt:
        for record in (f for f in manifest.files if only is None or only(f.file)):

            def read(_: Path, rank: int = record.rank) -> str:
                units = ckpt.load_rank(rank)
                return f", {len(units)} units, checksums match"

            checks.append(check_file(directory / record.file, read, nbytes=record.nbytes))
    for side in (f for f in side_files if only is None or only(f.file)):

        def read_side(_: Path, record: FileRecord = side) -> str:
            read_side_file(directory, record)
            return ", digest matches"

        checks.append(check_file(directory / side.file, read_side, nbytes=side.nbytes))
    checks += _leftover_checks(directory, {manifest_path.name} | manifest.file_names())
    kind = "sharded checkpoint" if manifest.training is None else "whole sharded checkpoint (model, optimizer, extra)"
    return Verification(public(directory), kind, tuple(checks))  # named as inspect names it


def _leftover_checks(directory: Location, listed: set[str]) -> list[FileCheck]:
    """A line for each file an interrupted save of ours left beside the checkpoint (not part of it: the checkpoint
    is still whole), so the report does not call the directory clean."""
    stale = leftovers(directory, set(directory.listing()) - listed)
    detail = f"{LEFTOVER}, not part of this checkpoint (the next save into this directory removes it)"
    return [FileCheck(directory / name, True, detail) for name in sorted(stale)]


def present_and_sized(path: str | os.PathLike[str] | Location, manifest: Manifest | None = None) -> list[str]:
    """The cheap part of :func:`verify_sharded`: every file the manifest lists present with its size (one ``stat``
    each); one line per damaged file, naming it. ``manifest``: the one read already."""
    directory = checkpoint_dir(path)
    manifest = open_checkpoint(directory).manifest if manifest is None else manifest
    side_files = manifest.training.files if manifest.training is not None else ()
    checks = [
        check_file(directory / f.file, lambda _: None, nbytes=f.nbytes, sizes_only=True)
        for f in (*manifest.files, *side_files)
    ]
    return [f"{c.path.name}: {c.detail}" for c in checks if not c.ok]
