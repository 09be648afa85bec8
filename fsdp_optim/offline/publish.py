"""Offline outputs to an object store: written locally first (every local guarantee and check), then published.

A sharded checkpoint is published by the commit protocol of :mod:`fsdp_optim.disk.store_save` (rank and
side files under their save-unique names, then the manifest by a conditional put, then the replaced files
removed); any other output (a consolidated file, a safetensors export, a DCP directory) is uploaded file by file,
each object replaced whole. The local copy lives in ``$TMPDIR`` and is removed either way::

    with output_for("s3://bucket/out/full.pt") as local:   # local: /tmp/fsdp_optim-out-.../full.pt
        write_file(obj, local)
    # -> s3://bucket/out/full.pt

A sharded checkpoint's rank files can start uploading as soon as each is written (:func:`checkpoint_output`), while
the next one is being cut: the upload of a re-cut then overlaps its computing and writing. The commit rule holds:
the prefix's manifest is read (:meth:`~fsdp_optim.disk.store_save.StoreSaving.begin_save`) before the first
upload; a file the local writer moves later is uploaded from a hard link made when it was complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from fsdp_optim.disk.errors import CommitOutcomeUnknown
from fsdp_optim.disk.location import Begun, Location
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.locate import is_sharded_checkpoint, read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.writer import save_rules

__all__ = ["Uploads", "checkpoint_output", "output_for", "publish_checkpoint", "publish_files"]


@contextmanager
def output_for(
    out: str | os.PathLike[str] | Location,
    *,
    overwrite: bool = False,
    inputs: Iterable[object] = (),
    keep_checkpoint: bool = False,
) -> Iterator[str | os.PathLike[str]]:
    """``out`` itself when it is local; for a URL (or a store), a local path of the same name to write, published to
    ``out`` when the block succeeds (a sharded checkpoint if a manifest was written there, else its files).

    Refused before anything is written: ``out`` naming one of ``inputs``, and (``keep_checkpoint``, the command
    line's rule) a checkpoint already at ``out`` unless ``overwrite``."""
    with checkpoint_output(out, overwrite=overwrite, inputs=inputs, keep_checkpoint=keep_checkpoint) as (local, _):
        yield local


@contextmanager
def checkpoint_output(
    out: str | os.PathLike[str] | Location,
    *,
    overwrite: bool = False,
    inputs: Iterable[object] = (),
    keep_checkpoint: bool = False,
) -> Iterator[tuple[str | os.PathLike[str], Callable[[Path], None] | None]]:
    """:func:`output_for`, with ``file_done(path)`` to call when a rank file of the checkpoint being written is
    complete (``None`` where ``out`` is local: written in place, nothing to upload). For a URL (or store) its upload
    starts at once, in the background (one file at a time); whatever is not uploaded yet when the block ends is
    uploaded then, and the checkpoint committed. A failure removes the uploads."""
    target = where(out)
    publishing = partial(_published, target, str(out).rstrip("/"), overwrite=overwrite, inputs=inputs,
                         keep_checkpoint=keep_checkpoint)  # fmt: skip
    with target.written_here(publishing) as (local, file_done):
        yield local, file_done


@contextmanager
def _published(
    target: Location, url: str, local: Path, *, overwrite: bool, inputs: Iterable[object], keep_checkpoint: bool
) -> Iterator[Callable[[Path], None]]:
    """The checks, uploads and commit of :func:`checkpoint_output` for the local copy ``local`` of ``target``
    (``url``: as given)."""
    if any(str(i).rstrip("/") == url for i in inputs if i is not None):
        raise ValueError(f"output: {url} is also an input; write to another place")
    if keep_checkpoint and not overwrite and is_sharded_checkpoint(target):
        raise FileExistsError(f"output: {url} holds a checkpoint already; pass --overwrite to replace it")
    if keep_checkpoint and not overwrite and target.parent().size(target.name) is not None:
        raise FileExistsError(f"output: {url}: an object is there already; pass --overwrite to replace it")
    uploads = Uploads(target, overwrite=overwrite, links=local.parent / ".uploading")
    try:
        try:
            yield uploads.file_done
        except BaseException:
            uploads.abort()
            raise
        if (local / MANIFEST_NAME).is_file():
            uploads.commit(local)
        elif local.is_dir():
            publish_files(local, target)
        else:  # one object
            target.parent().upload(local, local.name)
    finally:
        uploads.abort()  # (nothing left to do after a commit)


def publish_checkpoint(local: Path, store: Location, *, overwrite: bool = False) -> None:
    """Upload the sharded checkpoint in ``local`` to ``store`` and commit it there (conditional put of the
    manifest; :class:`~fsdp_optim.disk.errors.ConcurrentCommitError` if another writer committed meanwhile)."""
    uploads = Uploads(store, overwrite=overwrite)
    try:
        uploads.commit(local)
    finally:
        uploads.abort()


class Uploads:
    """A sharded checkpoint's files uploaded to ``store`` (some while it is still being written: :meth:`file_done`),
    then committed (:meth:`commit`) or removed (:meth:`abort`). The prefix is read before the first upload."""

    def __init__(self, store: Location, *, overwrite: bool, links: Path | None = None) -> None:  # noqa: D107
        self.store, self.overwrite, self.links = store, overwrite, links
        self._rules = save_rules()  # (a store journals nothing: no save id or world size needed before the commit)
        self._save: Begun | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._early: dict[str, Future[None]] = {}
        self._uploaded: list[str] = []
        self._committed = False

    def _begun(self) -> Begun:
        if self._save is None:
            self._save = self.store.begin_save(self._rules, purpose="publish", overwrite=self.overwrite)
        return self._save

    def file_done(self, path: Path) -> None:
        """Start uploading the complete file ``path`` (a hard link keeps its bytes if the writer moves it)."""
        if self.links is None:
            raise ValueError("Uploads: file_done needs a directory for the links")
        self._begun()
        self.links.mkdir(exist_ok=True)
        os.link(path, self.links / path.name)
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="fsdp-optim-publish")
        self._early[path.name] = self._pool.submit(self.store.upload, self.links / path.name, path.name)

    def commit(self, local: Path) -> None:
        """Upload what is not uploaded yet of the checkpoint in ``local``, then put its manifest (conditionally)
        and tidy; a failure removes every upload, unless the manifest may have landed."""
        save = self._begun()
        manifest = read_manifest(local)
        try:
            for name in sorted(manifest.file_names()):
                early = self._early.pop(name, None)
                if early is not None:
                    early.result()
                else:
                    self.store.upload(local / name, name)
                self._uploaded.append(name)
            self.store.commit_manifest(self._rules, save, manifest_to_json(manifest))
        except CommitOutcomeUnknown:
            self._uploaded = []  # the manifest may be in place and list them: kept
            raise
        self._committed = True
        self.store.finish_save(save, failed=False, keep=frozenset(manifest.file_names()))

    def abort(self) -> None:
        """Stop: wait for the uploads under way, then (unless committed) remove every file uploaded."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        done = [name for name, f in self._early.items() if f.done() and not f.cancelled() and f.exception() is None]
        self._early = {}
        if not self._committed and (self._uploaded or done):
            self.store.delete([*self._uploaded, *done])
        self._uploaded = []


def publish_files(local: Path, store: Location) -> None:
    """Upload every file under ``local`` to the same relative names under ``store``."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        store.upload(path, path.relative_to(local).as_posix())
