"""Committing a sharded checkpoint to an object store, where there is no rename and no lock.

The protocol (one writer per save; any number of writers of one prefix can race and never mix)::

    begin (rank 0)    list the prefix: foreign objects refused (unless overwrite), the manifest's etag noted
    write (each rank) its rank file and side file under names unique to the save (optim-<id>-rank...), uploaded
                      from a local staging directory (multipart above the filesystem's block size)
    commit (rank 0)   manifest.json put with If-None-Match: * (no manifest found) or If-Match: <etag found>:
                      412 -> ConcurrentCommitError, and every rank removes what it uploaded
    tidy (rank 0)     objects the format claims (optim-*/train-* of other saves) that the new manifest does not list
                      and that are older than this save's own files: what replaced checkpoints and killed or
                      losing writers left. A foreign object is never deleted.

Why the age rule is safe: a writer that began before this save's first upload read the old manifest's etag (or
none), so its commit is bound to fail with 412 after this commit; a writer that begins later uploads later. Only a
doomed writer's files can be older, and a live writer's never are.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_optim.disk.locks import ForeignOutputError
from fsdp_optim.disk.storage import ObjectStore
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, MANIFEST_NAMES, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.reader import read_manifest
from fsdp_optim.formats.sharded.writer import CHECKPOINT

__all__ = ["StoreSave", "begin_store_save", "commit_manifest", "remove_own", "staging_dir", "tidy", "upload_files"]


@dataclass(frozen=True)
class StoreSave:
    """What rank 0 found when a save to ``store`` began: the manifest's etag (``None``: none there) and the files it
    lists (removed once this save's manifest replaced it)."""

    store: ObjectStore
    replaces: str | None
    replaced_files: frozenset[str] = frozenset()


def begin_store_save(store: ObjectStore, *, overwrite: bool) -> StoreSave:
    """Rank 0, before any rank writes: refuse a prefix holding objects that are not a checkpoint's (unless
    ``overwrite``: they are then left alone, never deleted) or a manifest that is not ours; note the manifest's
    etag for the conditional commit."""
    listing = store.listing()
    foreign = sorted(n for n in listing if n not in MANIFEST_NAMES and not CHECKPOINT.deletable(n))
    if foreign and not overwrite:
        raise ForeignOutputError(
            f"{store}: holds objects that are not an fsdp_optim checkpoint's ({', '.join(foreign[:5])}"
            f"{'...' if len(foreign) > 5 else ''}); write elsewhere, or pass overwrite=True to write beside them "
            "(they are never deleted)"
        )
    replaced: frozenset[str] = frozenset()
    etag = store.etag(MANIFEST_NAME)
    if MANIFEST_NAME in listing:
        try:
            replaced = frozenset(read_manifest(store).file_names())
        except (ValueError, OSError) as exc:
            raise ForeignOutputError(
                f"{store}: its {MANIFEST_NAME} is not an fsdp_optim manifest ({exc}); the commit would replace it, so "
                "it is refused even with overwrite (move or delete it yourself)"
            ) from None
    return StoreSave(store, etag, replaced)


def staging_dir(save_id: str, rank: int) -> Path:
    """A local directory for this rank's files before they are uploaded (``$TMPDIR``; removed after the upload)."""
    return Path(tempfile.mkdtemp(prefix=f"fsdp_optim-{save_id[:8]}-rank{rank}-"))


def upload_files(store: ObjectStore, staging: Path, names: Iterable[str]) -> None:
    """Upload the files ``names`` of ``staging`` under the same names, each removed locally once it is up."""
    for name in names:
        store.upload(staging / name, name)
        (staging / name).unlink()


def commit_manifest(save: StoreSave, manifest: Manifest) -> None:
    """Create the manifest if the prefix is still as :func:`begin_store_save` found it; else
    :class:`~fsdp_optim.disk.storage.ConcurrentCommitError` and nothing was written."""
    save.store.commit(MANIFEST_NAME, manifest_to_json(manifest), replaces=save.replaces)


def remove_own(store: ObjectStore, names: Iterable[str]) -> None:
    """After a failed save: remove what this rank uploaded (best effort: the next writer's :func:`tidy` removes the
    rest)."""
    try:
        store.delete(names)
    except OSError as exc:
        warnings.warn(
            f"{store}: could not remove this failed save's files ({exc}); the next save removes them", stacklevel=2
        )


def tidy(save: StoreSave, manifest: Manifest) -> list[str]:
    """After a commit: remove the files of the checkpoint it replaced, and the claimed objects the new manifest does
    not list that are older than its own files (see the module docstring). Returns the names removed; a failure
    only warns (the next save retries)."""
    store = save.store
    try:
        listing = store.listing()
        own = manifest.file_names()
        times = [listing[n].mtime for n in own if n in listing and listing[n].mtime is not None]
        oldest = min((t for t in times if t is not None), default=float("-inf"))
        stale = [
            n
            for n, o in listing.items()
            if CHECKPOINT.deletable(n)
            and n not in own
            and (n in save.replaced_files or (o.mtime is not None and o.mtime < oldest))
        ]
        store.delete(stale)
        return stale
    except OSError as exc:
        warnings.warn(
            f"{store}: could not remove the files of replaced or failed saves ({exc}); the next save will", stacklevel=2
        )
        return []


def cleanup_staging(staging: Path | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
