"""Where a path leads: :func:`where` (a :class:`~fsdp_optim.disk.location.Location`: a local directory, a backend
registered for the URL's scheme, or an fsspec store), :func:`register_backend` (a scheme's backend, the caller's own),
:func:`open_store` (the public way to name a store with its own settings), and :func:`downloaded` (one object fetched
whole, for the readers that take a local file). The fsspec backend is imported only for a URL that no registered
backend takes: a local save never loads it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_optim.disk.local_directory import LocalDirectory
from fsdp_optim.disk.location import Location, is_url

if TYPE_CHECKING:
    from fsdp_optim.disk.storage import ObjectStore

__all__ = ["downloaded", "open_store", "register_backend", "where"]

Opener = Callable[[str, Mapping[str, Any]], Location]  # (the URL, its storage options) -> its location
_BACKENDS: dict[str, Opener] = {}


def register_backend(scheme: str, opener: Opener) -> None:
    """Make ``opener(url, storage_options)`` the :class:`~fsdp_optim.disk.location.Location` of every URL of
    ``scheme`` (``"mystore"`` for ``mystore://bucket/run``), wherever the package takes a path: saves, loads, the
    manager, every offline verb. It takes precedence over fsspec's filesystem of the same scheme. A spawned rank
    registers it again by importing the module that does (register at that module's import); a location object
    passed instead of a URL needs no registration. ``ValueError`` for a scheme that is not one (``file`` included:
    local paths are the package's)."""
    name = scheme.lower()
    if not name.isascii() or not name[:1].isalpha() or not all(c.isalnum() or c in "+.-" for c in name):
        raise ValueError(f"scheme: expected a URL scheme such as 'mystore', found {scheme!r}")
    if name == "file":
        raise ValueError("scheme: 'file' is a local path, which the package's own LocalDirectory serves")
    _BACKENDS[name] = opener


def where(path: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The :class:`~fsdp_optim.disk.location.Location` a path names: a URL's
    :class:`~fsdp_optim.disk.storage.ObjectStore`, a local path's
    :class:`LocalDirectory`, a location (of any backend, one of the package's or the caller's) as itself. The one
    place that tells a URL from a local path; a URL goes to the backend registered for its scheme
    (:func:`register_backend`), else to fsspec's."""
    if isinstance(path, Location):
        return path
    if is_url(path):
        opener = _BACKENDS.get(str(path).split("://", 1)[0].lower())
        if opener is not None:
            return opener(str(path), dict(storage_options or {}))
        from fsdp_optim.disk.storage import ObjectStore

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
    from fsdp_optim.disk.storage import ObjectStore

    return ObjectStore.open(url, storage_options, deadline_s=deadline_s)
