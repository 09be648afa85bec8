"""Offline outputs to an object store: written locally first (every local guarantee and check), then published.

A sharded checkpoint is published through the one save driver (:func:`fsdp_optim.disk.save.saving`, with the
store's writer: rank and side files under their save-unique names, then the manifest by a conditional put, then the
replaced files removed); any other output (a consolidated file, a safetensors export, a DCP directory) is uploaded
file by file, each object replaced whole. The local copy lives in ``$TMPDIR`` and is removed either way::

    with output_for("s3://bucket/out/full.pt") as local:   # local: /tmp/fsdp_optim-out-.../full.pt
        write_file(obj, local)
    # -> s3://bucket/out/full.pt

A sharded checkpoint's rank files can start uploading as soon as each is written (:func:`checkpoint_output`), while
the next one is being cut: the upload of a re-cut then overlaps its computing and writing. The commit rule holds:
the prefix's manifest is read (:meth:`~fsdp_optim.disk.save.Writer.begin`) before the first upload; a file the local
writer moves later is uploaded from a hard link made when it was complete.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from fsdp_optim.disk.location import Location, base_name
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.save import Save, Staging, saving
from fsdp_optim.formats.sharded.locate import is_sharded_checkpoint, read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.writer import save_rules

__all__ = ["Uploads", "checkpoint_output", "output_for"]


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
    if keep_checkpoint and not overwrite and target.parent().size(base_name(target)) is not None:
        raise FileExistsError(f"output: {url}: an object is there already; pass --overwrite to replace it")
    staging = Staging(local, durable=False, scratch=True)  # (written_here's copy: removed after, either way)
    with saving(target.writer(save_rules()), None, save_id="", staging=staging) as save:
        uploads = Uploads(save, overwrite=overwrite, links=local.parent / ".uploading")
        try:
            yield uploads.file_done
            if (local / MANIFEST_NAME).is_file():
                uploads.commit(local)
            elif local.is_dir():  # every file to the same relative name (each object replaced whole: no commit point)
                for path in sorted(p for p in local.rglob("*") if p.is_file()):
                    target.write(path.relative_to(local).as_posix(), path)
            else:  # one object
                target.parent().write(local.name, local)
        finally:  # (before a failed save's uploads are removed: none may land after)
            uploads.stop()


class Uploads:
    """A sharded checkpoint's files uploaded within a save (some while it is still being written: :meth:`file_done`),
    then committed (:meth:`commit`); the driver removes them after a failure. The prefix is read before the first
    upload."""

    def __init__(self, save: Save, *, overwrite: bool, links: Path) -> None:  # noqa: D107
        self.save, self.overwrite, self.links = save, overwrite, links
        self._pool: ThreadPoolExecutor | None = None
        self._early: dict[str, Future[None]] = {}

    def file_done(self, path: Path) -> None:
        """Start uploading the complete file ``path`` (a hard link keeps its bytes if the writer moves it)."""
        self.save.begin(purpose="publish", overwrite=self.overwrite)
        self.links.mkdir(exist_ok=True)
        os.link(path, self.links / path.name)
        self.save.published.append(path.name)  # (a failure from here on removes it)
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="fsdp-optim-publish")
        self._early[path.name] = self._pool.submit(self.save.writer.location.write, path.name, self.links / path.name)

    def stop(self) -> None:
        """Wait for the uploads under way (those not started yet are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def commit(self, local: Path) -> None:
        """Publish what is not uploaded yet of the checkpoint in ``local``, then commit its manifest (a conditional
        put)."""
        self.save.begin(purpose="publish", overwrite=self.overwrite)
        manifest = read_manifest(local)
        for future in self._early.values():
            future.result()  # (a failed early upload fails the save)
        self.save.publish(sorted(set(manifest.file_names()) - set(self._early)))
        self.save.commit(manifest_to_json(manifest), keep=manifest.file_names())

