"""A checkpoint manager's root on disk: what each step directory holds, and removing one of ours.

    root/step-00000008/manifest.json + optim-* + train-*   complete (verified: every file, every checksum)
    root/step-00000010/optim-* train-* (no manifest)         torn: a save killed before its commit
    root/step-00000006/... one file fails its checksum       damaged
    root/.step-00000010.fsdp-optim.lock                      the writer's lock and journal, beside the directory
    root/notes.txt, root/runs/, root/step-00000002/notes.txt foreign: never deleted, nor a directory holding it

A step directory is *ours* when its name is :func:`~fsdp_optim.core.steps.step_dir_name`'s and it holds only
names our writer makes (``manifest.json``, rank and side files, their temporary files), with a manifest that
reads as ours or no manifest at all (torn). Only ours are ever removed (:func:`remove_step`), under the
directory's own lock, so a writer of that step cannot be running at the time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from fsdp_optim.core.steps import parse_step_dir
from fsdp_optim.disk.atomic import TAGGED_TEMP_NAME, TEMP_NAME
from fsdp_optim.disk.errors import StoreUnavailable
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAMES, Manifest
from fsdp_optim.formats.sharded.verification import present_and_sized, verify_sharded
from fsdp_optim.formats.sharded.writer import CHECKPOINT

__all__ = ["COMPLETE", "DAMAGED", "TORN", "StepDir", "find_step_dirs", "remove_step", "survey_step"]

COMPLETE, TORN, DAMAGED = "complete", "torn", "damaged"


@dataclass(frozen=True)
class StepDir:
    """What one step directory holds. ``state``: :data:`COMPLETE`, :data:`TORN` (no manifest) or :data:`DAMAGED`
    (``reason`` says which file and what); ``foreign``: names in it that our writer never makes."""

    step: int
    path: Path | Location
    state: str
    reason: str
    nbytes: int  # of the regular files in the directory
    foreign: tuple[str, ...] = ()
    world_size: int | None = None  # from a readable manifest
    model: bool = False  # holds the weights (a whole checkpoint), not the optimizer state alone
    optimizer: str | None = None  # the optimizer's class, None when saved without one
    manifest_readable: bool = False

    @property
    def ours(self) -> bool:
        """Recognised as a checkpoint of ours, which a prune may remove: nothing foreign in it, and a manifest of
        ours or none at all."""
        return not self.foreign and (self.manifest_readable or self.state == TORN)


def _is_ours(name: str) -> bool:
    """A name our writer makes inside a checkpoint directory (or its temporary file, left by a killed write)."""
    temp = TEMP_NAME.match(name) or TAGGED_TEMP_NAME.match(name)
    final = temp.group("final") if temp else name
    return final in MANIFEST_NAMES or CHECKPOINT.deletable(final)


def find_step_dirs(root: str | os.PathLike[str] | Location) -> list[tuple[int, Path | Location]]:
    """``(step, path)`` of every step directory in ``root`` (a real directory, not a link; in a store, a prefix
    holding an object: an emptied one may stay listed by its marker), by step; [] when ``root`` does not exist yet."""
    place = where(root)
    steps = ((s, place.child(n)) for n in place.prefixes() if (s := parse_step_dir(n)) is not None)
    return sorted(((s, d.public()) for s, d in steps if d.present()), key=lambda found: found[0])


def survey_step(step: int, path: Path | Location, *, verify: bool = True) -> StepDir:
    """Classify one step directory; ``verify``: every byte against its checksum (else sizes only, one ``stat``
    per file). Never raises for what it finds; reads nothing outside ``path``."""
    names, foreign, nbytes = _contents(path)
    base = StepDir(step, path, TORN, "", nbytes, foreign)
    if not any(n in MANIFEST_NAMES for n in names):
        ours = [n for n in names if n not in foreign]
        shown = ", ".join(ours[:3]) + (", ..." if len(ours) > 3 else "")
        return replace(base, reason=f"no manifest: a save that did not finish ({len(ours)} files: {shown or '-'})")
    try:
        manifest = read_manifest(path)
    except StoreUnavailable:
        raise  # the store did not answer: not damage (a manager must not skip a good step for an outage)
    except (ValueError, OSError) as exc:
        return replace(base, state=DAMAGED, reason=f"its manifest is not readable: {exc}")
    base = _described(base, manifest)
    if verify:
        report = verify_sharded(path)
        damaged = [line.removeprefix(f"{path}{os.sep}").removeprefix(f"{path}/") for line in report.damaged()]
    else:
        damaged = present_and_sized(path)
    if damaged:
        return replace(base, state=DAMAGED, reason="; ".join(damaged))
    return replace(base, state=COMPLETE)


def _contents(path: Path | Location) -> tuple[list[str], tuple[str, ...], int]:
    """The names in a step directory, those our writer never makes (or that are not objects: a local directory's
    subdirectories and links), and the bytes of its objects."""
    place = where(path)
    listing, others = place.listing(), place.non_objects()
    names = sorted([*listing, *others])
    foreign = tuple(n for n in names if n in others or not _is_ours(n))
    return names, foreign, sum(o.size for o in listing.values())


def _described(base: StepDir, manifest: Manifest) -> StepDir:
    return replace(
        base,
        world_size=manifest.world_size,
        model=manifest.training is not None,
        optimizer=manifest.optimizer,
        manifest_readable=True,
    )


def remove_step(step_dir: StepDir) -> bool:
    """Remove a step directory of ours (:attr:`StepDir.ours`), under its lock (a store has none): its manifest first
    (the step is then torn, never damaged), the rest of its files, the directory (or a store's marker), then its lock
    file. False, with nothing removed, when a writer holds its lock or it now holds something foreign."""
    assert step_dir.ours, f"remove_step is for a step directory of ours, not {step_dir.path} ({step_dir.foreign})"
    place = where(step_dir.path)
    with place.guarded(purpose="remove an old checkpoint (CheckpointManager)") as held:
        if not held:
            return False
        names, foreign, _ = _contents(place)
        if foreign:
            return False  # something foreign arrived since the survey: keep all of it
        manifests = [n for n in names if n in MANIFEST_NAMES]
        place.delete(manifests)
        place.delete(n for n in names if n not in manifests)
        place.remove_marker()
    return True
