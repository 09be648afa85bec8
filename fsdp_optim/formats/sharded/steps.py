"""A checkpoint verified, and a checkpoint manager's root on disk: what each step directory holds, and removing one
of ours.

:func:`verify_sharded` (what :func:`fsdp_optim.verify` and ``fsdp-optim list`` run) changes nothing: the manifest
(its own checksum), then per rank file: present, of the manifest's size, its header's checksum the manifest's,
every byte against its checksum (format 2 and 3: every chunk's; format 1: every zip record's CRC-32 and every unit's
digest); in a whole checkpoint every side file: present, of its size, its bytes against the manifest's digest. Each
file is read once, into memory, and released. A manager root::

    root/step-00000008/manifest.json + optim-* + train-*   complete (verified: every file, every checksum)
    root/step-00000010/optim-* train-* (no manifest)         torn: a save killed before its commit
    root/step-00000006/... one file fails its checksum       damaged
    root/step-00000004/... + root/.step-00000004.pruning     being pruned: a prune that did not finish
    root/.step-00000010.fsdp-optim.lock                      the writer's lock and journal, beside the directory
    root/notes.txt, root/runs/, root/step-00000002/notes.txt foreign: never deleted, nor a directory holding it

A step directory is *ours* when its name is :func:`~fsdp_optim.core.steps.step_dir_name`'s and it holds only
names our writer makes (``manifest.json``, rank and side files, their temporary files), with a manifest that
reads as ours or no manifest at all (torn). Only ours are ever removed (:func:`remove_step`), under the
directory's own lock, so a writer of that step cannot be running at the time.

A removal is crash-safe: it first writes its mark beside the directory (``.step-N.pruning``, written atomically and
fsynced), and deletes it only after the directory is gone; the lock file goes last. A removal killed at any moment
leaves the step *being pruned* (never torn), or a mark or lock file with no directory beside it, which the next
prune's :func:`tidy_root` removes (a lock file only while no writer holds it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from fsdp_optim.core.steps import parse_pruning_mark, parse_step_dir, pruning_mark_name, step_dir_name
from fsdp_optim.disk.atomic import TAGGED_TEMP_NAME, TEMP_NAME
from fsdp_optim.disk.errors import StoreUnavailable
from fsdp_optim.disk.file_check import FileCheck, Verification, check_file
from fsdp_optim.disk.location import Location, non_objects, present, public
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.locks import LOCK_SUFFIX
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.locate import checkpoint_dir, read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, MANIFEST_NAMES, Manifest
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.side_file import read_side_file
from fsdp_optim.formats.sharded.writer import CHECKPOINT, leftovers

__all__ = [
    "COMPLETE",
    "DAMAGED",
    "LEFTOVER",
    "PRUNING",
    "TORN",
    "StepDir",
    "find_step_dirs",
    "present_and_sized",
    "pruning_marks",
    "remove_step",
    "survey_root",
    "survey_step",
    "tidy_root",
    "verify_sharded",
]

COMPLETE, TORN, DAMAGED, PRUNING = "complete", "torn", "damaged", "being pruned"
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
        for record in (f for f in (*manifest.files, *side_files) if only is None or only(f.file)):

            def read(_: Path, record: FileRecord = record) -> str:
                if record in side_files:
                    read_side_file(directory, record)
                    return ", digest matches"
                return f", {len(ckpt.load_rank(record.rank))} units, checksums match"

            checks.append(check_file(directory / record.file, read, nbytes=record.nbytes))
    # each file an interrupted save of ours left beside it (the checkpoint is still whole): not called clean
    stale = leftovers(directory, set(directory.listing()) - {manifest_path.name} - manifest.file_names())
    detail = f"{LEFTOVER}, not part of this checkpoint (the next save into this directory removes it)"
    checks += [FileCheck(directory / name, True, detail) for name in sorted(stale)]
    kind = "sharded checkpoint" if manifest.training is None else "whole sharded checkpoint (model, optimizer, extra)"
    return Verification(public(directory), kind, tuple(checks))  # named as inspect names it


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


@dataclass(frozen=True)
class StepDir:
    """What one step directory holds. ``state``: :data:`COMPLETE`, :data:`TORN` (no manifest), :data:`DAMAGED`
    (``reason`` says which file and what) or :data:`PRUNING` (a prune's mark beside it: its removal did not finish);
    ``foreign``: names in it that our writer never makes."""

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
        return not self.foreign and (self.manifest_readable or self.state in (TORN, PRUNING))


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
    return sorted(((s, public(d)) for s, d in steps if present(d)), key=lambda found: found[0])


def pruning_marks(root: str | os.PathLike[str] | Location) -> frozenset[int]:
    """The steps whose prune's mark is in ``root`` (their removal began and did not finish), from one listing."""
    return frozenset(s for n in where(root).listing() if (s := parse_pruning_mark(n)) is not None)


def survey_root(root: str | os.PathLike[str] | Location, *, verify: bool) -> list[StepDir]:
    """:func:`survey_step` of every step directory in ``root``, by step, those a prune began to remove included."""
    marked = pruning_marks(root)
    return [survey_step(s, p, verify=verify, pruning=s in marked) for s, p in find_step_dirs(root)]


def survey_step(step: int, path: Path | Location, *, verify: bool = True, pruning: bool = False) -> StepDir:
    """Classify one step directory; ``verify``: every byte against its checksum (else sizes only, one ``stat``
    per file); ``pruning``: its prune's mark is beside it (:data:`PRUNING`, nothing read but its listing). Never
    raises for what it finds; reads nothing outside ``path``."""
    names, foreign, nbytes = _contents(path)
    base = StepDir(step, path, TORN, "", nbytes, foreign)
    if pruning:
        return replace(base, state=PRUNING, reason="a prune began to remove it; the next save or prune finishes")
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
    base = replace(base, world_size=manifest.world_size, model=manifest.training is not None,
                   optimizer=manifest.optimizer, manifest_readable=True)  # fmt: skip
    if verify:
        report = verify_sharded(path)
        damaged = [line.removeprefix(f"{path}{os.sep}").removeprefix(f"{path}/") for line in report.damaged()]
    else:
        damaged = present_and_sized(path, manifest)
    if damaged:
        return replace(base, state=DAMAGED, reason="; ".join(damaged))
    return replace(base, state=COMPLETE)


def _contents(path: Path | Location) -> tuple[list[str], tuple[str, ...], int]:
    """The names in a step directory, those our writer never makes (or that are not objects: a local directory's
    subdirectories and links), and the bytes of its objects."""
    place = where(path)
    listing, others = place.listing(), non_objects(place)
    names = sorted([*listing, *others])
    foreign = tuple(n for n in names if n in others or not _is_ours(n))
    return names, foreign, sum(o.size for o in listing.values())


def remove_step(root: str | os.PathLike[str] | Location, step_dir: StepDir) -> bool:
    """Remove a step directory of ours (:attr:`StepDir.ours`) in ``root``, under its lock (a store has none): its
    prune's mark written beside it first (the step is then :data:`PRUNING`, never torn), its manifest, the rest of
    its files, the directory (or a store's marker), the mark, then its lock file. False, with nothing removed, when a
    writer holds its lock or it now holds something foreign."""
    assert step_dir.ours, f"remove_step is for a step directory of ours, not {step_dir.path} ({step_dir.foreign})"
    place, home = where(step_dir.path), where(root)
    mark = pruning_mark_name(step_dir.step)
    with place.removal(purpose="remove an old checkpoint (CheckpointManager)") as remove_marker:
        if remove_marker is None:
            return False
        names, foreign, _ = _contents(place)
        if foreign:
            return False  # something foreign arrived since the survey: keep all of it
        home.write(mark, f"{step_dir_name(step_dir.step)} is being removed by a prune\n".encode())
        manifests = [n for n in names if n in MANIFEST_NAMES]
        place.delete(manifests)
        place.delete(n for n in names if n not in manifests)
        remove_marker()
        home.delete([mark])
        home.delete(n for n in home.listing() if _marked_step(n) == step_dir.step)
    return True


def _marked_step(name: str) -> int | None:
    """The step of the temporary file a write of a prune's mark killed mid-way left."""
    temp = TEMP_NAME.match(name)
    return parse_pruning_mark(temp.group("final")) if temp else None


def tidy_root(root: str | os.PathLike[str] | Location, *, saved: int) -> list[str]:
    """What killed prunes left in ``root`` with no step directory beside it, removed: their marks (and a mark's
    temporary file), and their lock files (each taken first: one a writer holds is kept). The mark of ``saved``
    is dropped too: that step was just saved again. Returns the names removed."""
    home = where(root)
    names = home.listing()
    present = {s for s, _ in find_step_dirs(home)}
    marks = [n for n in names if (s := parse_pruning_mark(n)) is not None and (s == saved or s not in present)]
    marks += [n for n in names if (s := _marked_step(n)) is not None and s not in present]
    home.delete(marks)
    locks = []
    for name in names:
        step = parse_step_dir(name[1:].removesuffix(LOCK_SUFFIX)) if name.endswith(LOCK_SUFFIX) else None
        if step is None or step in present:
            continue  # a lock beside a step directory may hold a killed save's journal: its next writer reads it
        orphan = home.child(step_dir_name(step))
        with orphan.removal(purpose="remove a killed prune's lock (CheckpointManager)") as removable:
            if removable is not None:
                locks.append(name)
    return marks + locks
