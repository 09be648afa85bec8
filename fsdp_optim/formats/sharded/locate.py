"""Finding a sharded checkpoint and reading its manifest: a local directory (or its manifest file), or a prefix of an
object store (a URL or an :class:`~fsdp_optim.disk.storage.ObjectStore`). :mod:`.reader` opens what these find.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_optim.core.steps import parse_step_dir
from fsdp_optim.disk.byte_io import read_all
from fsdp_optim.disk.location import Location, base_name, non_objects, present
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.objects import check_tree
from fsdp_optim.disk.untrusted import load_file, open_regular
from fsdp_optim.formats.sharded.legacy import read_torch_header, unwrap
from fsdp_optim.formats.sharded.manifest import (
    LEGACY_MANIFEST_NAME,
    MANIFEST_NAME,
    MANIFEST_NAMES,
    Manifest,
)
from fsdp_optim.formats.sharded.manifest_json import MAX_MANIFEST_BYTES, manifest_from_json

__all__ = [
    "checkpoint_dir",
    "checkpoint_location",
    "is_json_manifest",
    "is_sharded_checkpoint",
    "manifest_at",
    "manifest_file",
    "read_manifest",
    "source_kind",
]


def checkpoint_dir(path: str | os.PathLike[str] | Location) -> Location:
    """The location of a sharded checkpoint given its directory (a store's prefix) or its manifest (a location given
    as one stays itself: its own reads, such as the memory tier's prefetch from peers, are kept)."""
    return checkpoint_location(where(path))


def checkpoint_location(place: Location) -> Location:
    """:func:`checkpoint_dir` of a location already resolved."""
    return place.parent() if _names_manifest(place) else place


def _names_manifest(place: Location) -> bool:
    """``place`` names a checkpoint's manifest (by name: no place of its own there), not its directory."""
    return base_name(place) in MANIFEST_NAMES and not present(place)


def _holds(place: Location, name: str) -> bool:
    """Whether ``place`` has an entry ``name`` (an object, or a symlink or directory, refused when read)."""
    try:
        return place.size(name) is not None or name in non_objects(place)
    except NotADirectoryError:  # a file, not a place holding entries
        return False


def manifest_file(directory: Path) -> Path | None:
    """The manifest in ``directory``: ``manifest.json`` (formats 2, 3), else ``manifest.pt`` (1); lexists: one that
    is not a regular file is refused saying so when it is read."""
    return next((directory / n for n in MANIFEST_NAMES if os.path.lexists(directory / n)), None)


def is_sharded_checkpoint(path: str | os.PathLike[str] | Location) -> bool:
    """``path`` is a checkpoint's directory (a store's prefix) holding a manifest, or that manifest itself (judged
    by name and presence, not read)."""
    return _is_sharded(where(path))


def _is_sharded(place: Location) -> bool:
    if _names_manifest(place):
        return _holds(place.parent(), base_name(place))
    return any(_holds(place, name) for name in MANIFEST_NAMES)


def source_kind(path: str | os.PathLike[str] | Location) -> str:
    """``"sharded"`` (a checkpoint directory or its manifest) or ``"file"`` (one object, read whole);
    ``FileNotFoundError`` for nothing there, ``ValueError`` for a directory (a prefix holding objects) without a
    manifest."""
    place = where(path)
    if _is_sharded(place):
        return "sharded"
    if present(place):
        raise ValueError(
            f"{place}: not a sharded checkpoint directory, a directory without a {MANIFEST_NAME} or "
            f"{LEGACY_MANIFEST_NAME} "
            f"(a save that never finished leaves none), and not a full dict file{_manager_root_hint(place)}"
        )
    if not base_name(place) or not _holds(place.parent(), base_name(place)):
        raise FileNotFoundError(f"{place}: no such file or directory (there is no such checkpoint directory or file)")
    return "file"


def _manager_root_hint(place: Location) -> str:
    """For a directory of step directories (a ``CheckpointManager`` root): where its checkpoints are."""
    try:
        steps = [name for name in place.prefixes() if parse_step_dir(name) is not None]
    except OSError:
        return ""
    if not steps:
        return ""
    shown = ", ".join(steps[:2]) + (", ..." if len(steps) > 2 else "")
    return (
        f"; it holds step directories ({shown}): a CheckpointManager root, whose steps `fsdp-optim list {place}` "
        f"shows (each step directory is a checkpoint)"
    )


def read_manifest(path: str | os.PathLike[str] | Location) -> Manifest:
    """Read and verify a manifest: ``path`` is a checkpoint directory, its manifest, or a layout file (or a URL of a
    checkpoint's prefix or manifest)."""
    return manifest_at(where(path))


def manifest_at(place: Location) -> Manifest:
    """:func:`read_manifest` of a location already resolved. A capability, not a backend: where the objects are local
    files, a manifest is read as one (format 1's torch file, a layout file of any name, never followed through a
    symlink); elsewhere as bytes."""
    path = place.local_path()
    if path is None:
        return _read_remote_manifest(checkpoint_location(place))
    file = manifest_file(path) if path.is_dir() else path
    if file is None or not os.path.lexists(file):
        if path.is_dir():
            raise ValueError(
                f"{path}: not a sharded checkpoint directory (no {MANIFEST_NAME} or {LEGACY_MANIFEST_NAME}; a save "
                "that never finished leaves none)"
            )
        raise FileNotFoundError(f"{path}: no such checkpoint directory or file")
    follow = file.name not in MANIFEST_NAMES  # a manifest is never followed through a symlink (a layout file is)
    if file.suffix == ".json" or _starts_with_brace(file):  # a JSON manifest (a layout file, whatever its name)
        return manifest_from_json(_read_bounded(file, follow_symlinks=follow), source=str(file))
    obj = load_file(file, follow_symlinks=follow)
    read_torch_header(obj, "manifest", source=str(file), covered="body")  # its kind first, then what it holds
    check_tree(obj, str(file))
    _, body = unwrap(obj, "manifest", source=str(file))
    return Manifest.from_dict(body, source=str(file))


def _read_remote_manifest(store: Location) -> Manifest:
    try:
        data = read_all(store, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ValueError(
            f"{store}: not a sharded checkpoint (no {MANIFEST_NAME} under this prefix; a save that never committed "
            "leaves none)"
        ) from None
    return manifest_from_json(data, source=str(store / MANIFEST_NAME))


def is_json_manifest(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that starts like a JSON document (a layout file of ours, or a manifest)."""
    return Path(path).is_file() and _starts_with_brace(Path(path))


def _starts_with_brace(file: Path) -> bool:
    """Whether a regular file's first byte is ``{`` (a torch file starts with a zip header)."""
    try:
        fd, _ = open_regular(file)
    except (OSError, ValueError):
        return False  # the torch reader says what is wrong with it
    try:
        return os.pread(fd, 1, 0) == b"{"
    finally:
        os.close(fd)


def _read_bounded(file: Path, *, follow_symlinks: bool) -> bytes:
    fd, st = open_regular(file, follow_symlinks=follow_symlinks)
    try:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{file}: {st.st_size} bytes, above the bound for a manifest ({MAX_MANIFEST_BYTES})")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(st.st_size + 1)
    finally:
        os.close(fd)
