"""Writing a sharded checkpoint: rank files, the manifest last, and the rules every writer follows (lock, recover,
refuse what is not ours, journal, commit). Writers never destroy: only what a manifest or a journal recorded is deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_optim.core.limits import MAX_WORLD_SIZE
from fsdp_optim.disk.atomic import TAGGED_TEMP_NAME, TEMP_NAME, atomic_save, atomic_write, new_save_id
from fsdp_optim.disk.locks import ForeignOutputError, OutputLock, lock_output, resolve_output
from fsdp_optim.disk.untrusted import describe_file, escape
from fsdp_optim.formats.sharded.manifest import (
    CHECKPOINT_VERSION,
    LEGACY_MANIFEST_NAME,
    MANIFEST_NAME,
    MANIFEST_NAMES,
    FileRecord,
    Manifest,
    shard_file_name,
)
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.rank_file import write_rank_file
from fsdp_optim.formats.sharded.reader import manifest_file, read_manifest
from fsdp_optim.formats.sharded.segments import CHUNK_BYTES

# Rank files of both formats; a format-2 commit also removes the manifest.pt of the format-1 checkpoint it replaces.
_SHARD_FILE = re.compile(r"^optim-[0-9a-f]+-rank\d+-of-\d+\.(pt|safetensors)$")



_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")



def write_shard_file(
    directory: Path, state: Mapping[int, Mapping[str, Any]], *, save_id: str, rank: int, world_size: int
) -> FileRecord:
    """Write one rank's file atomically (format 2: a safetensors file, :mod:`.rank_file`); its record for the manifest.

    ``state`` is ``{flat: {key: padded 1-D shard or scalar}}``; scalars are the manifest's to hold.
    """
    name = shard_file_name(save_id, rank, world_size)
    metadata = {
        "format": "fsdp_optim",
        "kind": "shard",
        "version": str(CHECKPOINT_VERSION),
        "save_id": save_id,
        "rank": str(rank),
        "world_size": str(world_size),
    }
    size, (checksum, segments) = atomic_write(
        directory / name, lambda file: write_rank_file(file, state, metadata, CHUNK_BYTES)
    )
    return FileRecord(rank, name, checksum, size, segments)



def write_manifest(directory: Path, manifest: Manifest, *, replaces: Iterable[str] = ()) -> Path:
    """Commit a checkpoint: write its manifest atomically (last), then remove the rank files of the
    checkpoint it replaces (``replaces``: the previous manifest's files, from :func:`begin_write`)."""
    path = directory / MANIFEST_NAME
    data = manifest_to_json(manifest)  # before anything is written: a value JSON cannot hold is refused here
    atomic_write(path, lambda file: file.write(data), tag=manifest.save_id[:12])
    remove_stale_files(directory, replaces, keep={f.file for f in manifest.files})
    return path



def remove_stale_files(directory: Path, names: Iterable[str], *, keep: set[str]) -> list[str]:
    """Delete ``names`` but ``keep`` from ``directory``: only rank-file names, only files (never a
    directory), never followed. ``names`` come from a manifest of ours or our lock's journal: a file
    this package did not record is never deleted, whatever its name."""
    removed = []
    for name in sorted(set(names) - keep):
        target = directory / name
        if (_SHARD_FILE.match(name) or name == LEGACY_MANIFEST_NAME) and (target.is_symlink() or target.is_file()):
            target.unlink(missing_ok=True)
            removed.append(name)
    return removed



def check_not_input(output: str | os.PathLike[str], inputs: Iterable[Any], *, name: str = "out_dir") -> None:
    """Refuse an output that resolves (real path, or the same inode) to one of ``inputs``: a file, a
    checkpoint directory (or its manifest) and every file in that directory."""
    real = resolve_output(output)
    for given in inputs:
        if given is None or isinstance(given, Mapping) or not isinstance(given, (str, os.PathLike)):
            continue
        path = Path(given)
        candidates = [path]
        directory = path if path.is_dir() else path.parent if path.name in MANIFEST_NAMES else None
        if directory is not None:
            candidates += [directory, *directory.iterdir()]
        for candidate in candidates:
            if resolve_output(candidate) == real or _same_inode(candidate, real):
                raise ValueError(f"{name}: {output} is {candidate}, one of the inputs; write to another path")



def _same_inode(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False



def begin_write(
    out: str | os.PathLike[str],
    *,
    save_id: str,
    world_size: int,
    purpose: str,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
    staging: str | None = None,
) -> OutputLock:
    """What a writer of a checkpoint directory does before it writes anything; returns the held lock.

    1. Refuse ``out`` if it is one of ``inputs`` (:func:`check_not_input`).
    2. Take ``out``'s lock (:func:`fsdp_optim.locks.lock_output`; a second writer gets ``OutputLockedError``).
    3. Remove what a killed writer of ``out`` left, exactly as its journal announced it (:func:`recover`).
    4. Refuse a directory holding anything but ours (:func:`owned_files`) unless ``overwrite``.
    5. Journal this write: its save id and world size (so its rank files and temporary files are known
       by name), the rank files its commit will replace, its staging directory (beside ``out``).

    Finish with :func:`end_write`, which removes this write's files if it failed.
    """
    check_not_input(out, inputs)
    lock = lock_output(out, purpose=purpose)
    try:
        if lock.previous:
            recover(lock.output, lock.previous)
            lock.forget()
        replaces = owned_files(lock.output, overwrite=overwrite)
        lock.journal(
            {"save_id": save_id, "world_size": world_size, "replaces": sorted(replaces), "staging": staging}
        )
    except BaseException:
        lock.release()
        raise
    return lock



def end_write(lock: OutputLock, *, failed: bool) -> None:
    """Release a lock from :func:`begin_write`; if the write failed, first remove what it created."""
    try:
        if failed:
            recover(lock.output, lock.entries)
    finally:
        lock.release()



def owned_files(directory: Path, *, overwrite: bool = False) -> set[str]:
    """The rank files of the checkpoint in ``directory`` (what a new commit there replaces).

    Ours is ``manifest.json`` (or ``manifest.pt``, format 1) when it reads as an fsdp_optim manifest, and the
    rank files it lists; a ``manifest.pt`` beside a ``manifest.json`` (a format-2 commit over format 1 that
    was killed before removing it) is ours too, with its files, when it reads as ours. Anything else (a
    foreign or unreadable manifest, any other file or directory) is *foreign*: refused with
    :class:`ForeignOutputError` unless ``overwrite``, and never deleted either way. Something that exists
    and is not a directory is refused always.
    """
    if not os.path.lexists(directory):
        return set()
    if not directory.is_dir():
        raise ForeignOutputError(f"{directory}: exists and is not a directory ({describe_file(directory)})")
    names = set(os.listdir(directory))
    files: set[str] = set()
    problems = []
    for manifest in (n for n in MANIFEST_NAMES if n in names):
        try:
            listed = {f.file for f in read_manifest(directory / manifest).files}
            files |= listed | ({manifest} if manifest == LEGACY_MANIFEST_NAME else set())
        except (ValueError, OSError) as exc:
            problems.append(f"its {manifest} is not an fsdp_optim manifest ({exc})")
    foreign = sorted(names - files - set(MANIFEST_NAMES)) if not problems else sorted(names - set(MANIFEST_NAMES))
    if (foreign or problems) and not overwrite:
        parts = list(problems)
        if foreign:
            shown = ", ".join(escape(n, limit=80) for n in foreign[:5])
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            parts.append(f"it holds files that are not an fsdp_optim checkpoint's: {shown}{more}")
        raise ForeignOutputError(
            f"{directory}: {'; '.join(parts)}; pass overwrite=True (--overwrite) to write there anyway (nothing "
            "there is deleted)"
        )
    return files if not problems else set()


def _referenced(directory: Path) -> set[str] | None:
    """Names the checkpoint in ``directory`` uses; empty without a manifest, ``None`` if it is unreadable."""
    manifest = manifest_file(directory)
    if manifest is None:
        return set()
    try:
        return {manifest.name} | {f.file for f in read_manifest(manifest).files}
    except (ValueError, OSError):
        return None


def recover(directory: Path, entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Remove what journal ``entries`` announced and the checkpoint in ``directory`` does not use.

    For a write of save id ``s`` at world size ``W``: its rank files ``optim-<s>-rank*-of-W.pt`` and
    their temporary files, its manifest's temporary file, the files it was to replace (once a newer
    manifest no longer names them) and its staging directory beside ``directory``; for a single file
    written with a tag, that file's temporary files. Rank files are kept while the manifest cannot be
    read (nothing proves them unused). Nothing else is touched.
    """
    referenced = _referenced(directory) if directory.is_dir() else set()
    own: set[str] = set()
    tagged: set[tuple[str, str]] = set()
    replaced: set[str] = set()
    stagings = []
    for entry in entries:
        sid, world_size = entry.get("save_id"), entry.get("world_size")
        if isinstance(sid, str) and _SAVE_ID.match(sid) and isinstance(world_size, int) and 0 < world_size <= MAX_WORLD_SIZE:
            own.update(shard_file_name(sid, r, world_size, version=v) for r in range(world_size) for v in (1, 2))
            tagged.update((name, sid[:12]) for name in MANIFEST_NAMES)
            staging = entry.get("staging")
            if isinstance(staging, str) and "/" not in staging and staging.startswith("."):
                stagings.append((directory.parent / staging, sid, world_size))
        if isinstance(entry.get("replaces"), list):
            replaced.update(n for n in entry["replaces"] if isinstance(n, str))
        if isinstance(entry.get("file"), str) and isinstance(entry.get("tag"), str):
            tagged.add((entry["file"], entry["tag"]))
    removed = []
    if directory.is_dir():
        removed += _sweep(directory, own, tagged)
        if referenced is not None:
            removed += remove_stale_files(directory, own | replaced, keep=referenced)
    for staging, sid, world_size in stagings:
        if staging.is_dir() and not staging.is_symlink():
            names = {shard_file_name(sid, r, world_size, version=v) for r in range(world_size) for v in (1, 2)}
            removed += _sweep(staging, names, set()) + remove_stale_files(staging, names, keep=set())
            with contextlib.suppress(OSError):  # not empty: something not ours is in there, leave it
                staging.rmdir()
    return removed



def _sweep(directory: Path, own: set[str], tagged: set[tuple[str, str]]) -> list[str]:
    """Delete the temporary files of ``own`` names and of ``(name, tag)`` pairs in ``directory``."""
    removed = []
    for entry in os.scandir(directory):
        plain, with_tag = TEMP_NAME.match(entry.name), TAGGED_TEMP_NAME.match(entry.name)
        ours = (plain is not None and plain["final"] in own) or (
            with_tag is not None and (with_tag["final"], with_tag["tag"]) in tagged
        )
        if ours and not entry.is_dir(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return removed



def write_all_or_nothing(
    out: str | os.PathLike[str],
    write: Callable[[Path], Manifest],
    *,
    save_id: str | None = None,
    world_size: int | None = None,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
) -> Path:
    """Have ``write`` put every rank file into a staging directory beside ``out`` and return the manifest;
    only then move the files into ``out`` and commit the manifest there (last). Holds ``out``'s lock
    throughout (:func:`begin_write`: refused if ``out`` is an input, locked, or foreign without
    ``overwrite``). A refused or failed write leaves ``out`` exactly as it was, or absent, and no
    staging behind; one killed midway is cleaned up by the next writer of ``out`` (given the save id and
    world size the manifest will have, by which its files are journaled)."""
    save_id = save_id or new_save_id()
    name = f".{resolve_output(out).name}.fsdp-optim-staging.{save_id[:12]}"
    lock = begin_write(
        out, save_id=save_id, world_size=world_size or 1, purpose="reshard", inputs=inputs, overwrite=overwrite, staging=name
    )
    target, staging = lock.output, lock.output.parent / name
    failed = True
    try:
        staging.mkdir(mode=0o700)
        manifest = write(staging)
        target.mkdir(exist_ok=True)
        for entry in staging.iterdir():
            os.replace(entry, target / entry.name)
        write_manifest(target, manifest, replaces=lock.entries[-1]["replaces"])
        failed = False
    finally:
        recover(target, [{**lock.entries[-1], "replaces": []}])  # the staging directory, and on failure our files
        end_write(lock, failed=failed)
    return Path(out) / MANIFEST_NAME



def write_file(obj: Any, path: str | os.PathLike[str], *, inputs: Iterable[Any] = ()) -> int:
    """:func:`atomic_save` of a single output file under its lock, refused if it is one of ``inputs``;
    the temporary file is journaled, so one left by a killed writer is removed by the next. Returns
    the file's size. An existing file at ``path`` is replaced (that is what ``-o FILE`` asks for)."""
    check_not_input(path, inputs, name="output")
    tag = uuid.uuid4().hex[:12]
    with lock_output(path, purpose="write a file") as lock:
        if lock.previous:
            recover(lock.output.parent, lock.previous)
            lock.forget()
        lock.journal({"file": lock.output.name, "tag": tag})
        return atomic_save(obj, lock.output, tag=tag)
