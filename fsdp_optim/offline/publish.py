"""Offline outputs to an object store: written locally first (every local guarantee and check), then published.

A sharded checkpoint is published by the commit protocol of :mod:`fsdp_optim.formats.sharded.store_commit` (rank and
side files under their save-unique names, then the manifest by a conditional put, then the replaced files
removed); any other output (a consolidated file, a safetensors export, a DCP directory) is uploaded file by file,
each object replaced whole. The local copy lives in ``$TMPDIR`` and is removed either way::

    with output_for("s3://bucket/out/full.pt") as local:   # local: /tmp/fsdp_optim-out-.../full.pt
        write_file(obj, local)
    # -> s3://bucket/out/full.pt
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fsdp_optim.disk.storage import CommitOutcomeUnknown, ObjectStore, is_url
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import is_sharded_checkpoint, read_manifest
from fsdp_optim.formats.sharded.store_commit import begin_store_save, commit_manifest, tidy

__all__ = ["output_for", "publish_checkpoint", "publish_files"]


@contextmanager
def output_for(
    out: str | os.PathLike[str] | ObjectStore,
    *,
    overwrite: bool = False,
    inputs: Iterable[object] = (),
    keep_checkpoint: bool = False,
) -> Iterator[Path]:
    """``out`` itself when it is local; for a URL (or a store), a local path of the same name to write, published to
    ``out`` when the block succeeds (a sharded checkpoint if a manifest was written there, else its files).

    Refused before anything is written: ``out`` naming one of ``inputs``, and (``keep_checkpoint``, the command
    line's rule) a checkpoint already at ``out`` unless ``overwrite``."""
    if not isinstance(out, ObjectStore) and not is_url(out):
        yield Path(out)
        return
    url = str(out).rstrip("/")
    if any(str(i).rstrip("/") == url for i in inputs if i is not None):
        raise ValueError(f"output: {url} is also an input; write to another place")
    if keep_checkpoint and not overwrite and is_sharded_checkpoint(out if isinstance(out, ObjectStore) else url):
        raise FileExistsError(f"output: {url} holds a checkpoint already; pass --overwrite to replace it")
    scratch = Path(tempfile.mkdtemp(prefix="fsdp_optim-out-"))
    try:
        local = scratch / url.rsplit("/", 1)[-1]
        yield local
        target = out if isinstance(out, ObjectStore) else ObjectStore.open(url)
        if (local / MANIFEST_NAME).is_file():
            publish_checkpoint(local, target, overwrite=overwrite)
        elif local.is_dir():
            publish_files(local, target)
        else:  # one object: the store of its prefix, with the same filesystem settings
            parent = ObjectStore(url.rsplit("/", 1)[0], target.fs, target.root.rsplit("/", 1)[0])
            parent.upload(local, local.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def publish_checkpoint(local: Path, store: ObjectStore, *, overwrite: bool = False) -> None:
    """Upload the sharded checkpoint in ``local`` to ``store`` and commit it there (conditional put of the
    manifest; :class:`~fsdp_optim.disk.storage.ConcurrentCommitError` if another writer committed meanwhile)."""
    save = begin_store_save(store, overwrite=overwrite)
    manifest = read_manifest(local)
    uploaded = []
    try:
        for name in sorted(manifest.file_names()):
            store.upload(local / name, name)
            uploaded.append(name)
        commit_manifest(save, manifest)
    except BaseException as exc:
        if not isinstance(exc, CommitOutcomeUnknown):  # else the manifest may be in place and list them
            store.delete(uploaded)
        raise
    tidy(save, manifest)


def publish_files(local: Path, store: ObjectStore) -> None:
    """Upload every file under ``local`` to the same relative names under ``store``."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        store.upload(path, path.relative_to(local).as_posix())
