"""Where a path leads: :func:`where` (a :class:`~fsdp_optim.disk.location.Location`: a local directory, a backend
registered for the URL's scheme, or an fsspec store), :func:`register_backend` (a scheme's backend, the caller's own)
and :func:`open_store` (the public way to name a store with its own settings). The fsspec backend is imported only for
a URL that no registered backend takes: a local save never loads it.

A backend of one's own reaches every process that names its scheme, the command line's included, without code of
the caller's: at the first URL of a scheme no backend is registered for, the modules ``$FSDP_OPTIM_BACKENDS`` names
(comma-separated) are imported, and then the entry point of that scheme's name in the group
:data:`ENTRY_POINT_GROUP` is loaded (a module that registers at its import, or the opener itself)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fsdp_optim.disk.local_directory import LocalDirectory
from fsdp_optim.disk.location import Location, is_url

if TYPE_CHECKING:
    from fsdp_optim.disk.storage import ObjectStore

__all__ = ["BACKENDS_ENV", "ENTRY_POINT_GROUP", "open_store", "register_backend", "where"]

Opener = Callable[[str, Mapping[str, Any]], Location]  # (the URL, its storage options) -> its location
_BACKENDS: dict[str, Opener] = {}
BACKENDS_ENV = "FSDP_OPTIM_BACKENDS"  # modules to import (comma-separated) at the first URL of an unknown scheme
ENTRY_POINT_GROUP = "fsdp_optim.backends"  # an entry point per scheme: a module that registers, or the opener
_SOUGHT: set[str] = set()  # the schemes already looked for (the modules of $FSDP_OPTIM_BACKENDS: "")
HOW_TO_ADD = (
    "a backend of one's own is registered with fsdp_optim.register_backend(scheme, opener) in a module that "
    f"${BACKENDS_ENV} names (comma-separated, imported at the first URL of an unknown scheme), or in an entry point "
    f"named for the scheme in the group '{ENTRY_POINT_GROUP}' (docs/backends.md)"
)


def register_backend(scheme: str, opener: Opener) -> None:
    """Make ``opener(url, storage_options)`` the :class:`~fsdp_optim.disk.location.Location` of every URL of
    ``scheme`` (``"mystore"`` for ``mystore://bucket/run``) wherever the package takes a path, before fsspec's
    filesystem of the same scheme. A spawned rank registers it again by importing the module that does.
    ``ValueError`` for a scheme that is not one (``file`` included: local paths are the package's)."""
    name = scheme.lower()
    if not name.isascii() or not name[:1].isalpha() or not all(c.isalnum() or c in "+.-" for c in name):
        raise ValueError(f"scheme: expected a URL scheme such as 'mystore', found {scheme!r}")
    if name == "file":
        raise ValueError("scheme: 'file' is a local path, which the package's own LocalDirectory serves")
    _BACKENDS[name] = opener


def where(path: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The :class:`~fsdp_optim.disk.location.Location` a path names (a location as itself): the one place that tells
    a URL (its scheme's registered backend, else fsspec's) from a local path."""
    if isinstance(path, Location):
        return path
    if is_url(path):
        scheme = str(path).split("://", 1)[0].lower()
        opener = _BACKENDS.get(scheme) or _discovered(scheme)
        if opener is not None:
            return opener(str(path), dict(storage_options or {}))
        from fsdp_optim.disk.storage import ObjectStore

        try:
            return ObjectStore.open(str(path), storage_options)
        except ValueError as exc:
            if not str(exc).startswith(f"{path}: no filesystem for the scheme"):
                raise
            raise ValueError(f"{exc}; {HOW_TO_ADD}") from None
    return LocalDirectory(path)


def _discovered(scheme: str) -> Opener | None:
    """The backend of a scheme no backend is registered for, found once per process (the module docstring); None:
    fsspec's."""
    if "" not in _SOUGHT:
        _SOUGHT.add("")
        for module in filter(None, (m.strip() for m in os.environ.get(BACKENDS_ENV, "").split(","))):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                why = f"${BACKENDS_ENV} names the module {module!r}, which cannot be imported: {exc}"
                raise ImportError(why) from exc
        if scheme in _BACKENDS:
            return _BACKENDS[scheme]
    if scheme in _SOUGHT:
        return _BACKENDS.get(scheme)
    _SOUGHT.add(scheme)
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP, name=scheme):
        loaded = point.load()
        if scheme not in _BACKENDS and callable(loaded) and not isinstance(loaded, type(importlib)):
            register_backend(scheme, loaded)
    return _BACKENDS.get(scheme)


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
