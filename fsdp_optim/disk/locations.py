"""Where a path leads: :func:`where` (a :class:`~fsdp_optim.disk.location.Location`: a local directory or a store),
:func:`open_store` (the public way to name a store with its own settings), and :func:`downloaded` (one object fetched
whole, for the readers that take a local file)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from fsdp_optim.disk.local_directory import LocalDirectory
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.storage import ObjectStore, is_url

__all__ = ["downloaded", "open_store", "where"]


def where(path: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The :class:`~fsdp_optim.disk.location.Location` a path names: a URL's :class:`ObjectStore`, a local path's
    :class:`LocalDirectory`, a location (of any backend, one of the package's or the caller's) as itself. The one
    place that tells a URL from a local path."""
    if isinstance(path, Location):
        return path
    if is_url(path):
        return ObjectStore.open(str(path), storage_options)
    return LocalDirectory(path)


@contextmanager
def downloaded(url: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[Path]:
    """The single object at ``url`` (a full dict file, a named safetensors file, a layout file...) fetched whole into
    a local temporary file of the same name, removed after the block: for the readers that take a file. A sharded
    checkpoint is never fetched this way (its readers fetch only the ranges they need)."""
    location = where(url, storage_options)
    with ExitStack() as stack:
        try:
            local = stack.enter_context(location.parent().fetched_whole(location.name))
        except FileNotFoundError:  # (only while fetching: the block's own errors pass as they are)
            raise FileNotFoundError(
                f"{url.rstrip('/')}: no such object, and no manifest.json under it (not a sharded checkpoint's "
                "prefix either)"
            ) from None
        yield local


def open_store(url: str, *, deadline_s: float | None = None, **storage_options: Any) -> ObjectStore:
    """The object store (or fsspec filesystem) prefix at ``url``, to pass wherever a checkpoint path is taken.

    A request that keeps failing (5xx, SlowDown, no connection) gives up ``deadline_s`` seconds after its first
    attempt, raising ``StoreUnavailable`` naming the object (default: ``$FSDP_OPTIM_STORE_DEADLINE_S``, else 60).

    ``storage_options`` go to the filesystem (for S3, s3fs's: ``key``, ``secret``, ``client_kwargs={"endpoint_url":
    ...}``...); without them the standard places are used (for S3 the AWS environment, ``AWS_ENDPOINT_URL``
    included, and config files). The store pickles (a spawned rank gets the same filesystem settings)::

        store = fsdp_optim.open_store("s3://bucket/run/step-100", client_kwargs={"endpoint_url": url})
        fsdp_optim.save_checkpoint(model, optim, store)
    """
    if not is_url(url):
        raise ValueError(f"url: expected a URL with a scheme (s3://, gs://, memory://...), found {url!r}")
    return ObjectStore.open(url, storage_options, deadline_s=deadline_s)
