"""A prefix of an object store or any fsspec filesystem (``s3://``, ``gs://``, ``memory://``...): :class:`ObjectStore`.

Credentials and endpoints come from the standard places (for S3 the AWS environment and config files,
``AWS_ENDPOINT_URL`` included) or from ``storage_options``, which are never printed.

A store has no rename and no lock, so a save writes its files under names unique to it, then creates the manifest
with a *conditional put* (:meth:`ObjectStore.commit`): ``If-None-Match: *`` where there was none, ``If-Match: <etag>``
over the one it replaces. Two writers of one prefix cannot both commit; the loser gets ``ConcurrentCommitError``.
S3 (and S3-compatible stores answering 412) gives that guarantee; other fsspec filesystems get a weaker mode that
checks, then writes (``ObjectStore.conditional`` is ``False``; the docs say so). Every request is retried on
transient errors, never past the store's deadline (:mod:`.store_policy`); the caller checks the bytes read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

from fsdp_optim.disk.byte_io import StoredObject, Tiling
from fsdp_optim.disk.errors import CommitOutcomeUnknown, ConcurrentCommitError, StoreUnavailable
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.multipart import S3Multipart
from fsdp_optim.disk.prefetch import SpanLike, StorePiece, StorePrefetch
from fsdp_optim.disk.store_policy import (
    MAX_CONCURRENT,
    PIECE_BYTES,
    Clock,
    RetryPolicy,
    describe,
    etag_of,
    mtime_of,
    precondition_failed,
    refused,
    refused_message,
)

__all__ = ["ObjectStore"]

T = TypeVar("T")


class ObjectStore(Location):
    """A prefix (a "directory") on an fsspec filesystem: ``ObjectStore.open("s3://bucket/run/step-100")``;
    ``str(store)`` is its URL (never its credentials)."""

    def __init__(self, url: str, fs: Any, root: str, policy: RetryPolicy | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.root = root.rstrip("/")
        self.policy = policy or RetryPolicy.default()
        # An asynchronous filesystem's calls take a timeout (fsspec cancels the call there): an attempt, the
        # client's own retries inside it included, never outlasts the request's deadline.
        self._timed = bool(getattr(fs, "async_impl", False))
        # S3 (s3fs) honours If-None-Match / If-Match on a put: a real compare-and-swap of the manifest.
        self.conditional = type(fs).__name__ == "S3FileSystem"

    @classmethod
    def open(
        cls, url: str, storage_options: Mapping[str, Any] | None = None, *, deadline_s: float | None = None
    ) -> ObjectStore:
        """The store at ``url`` (a trailing ``/manifest.json`` names its directory's store); a request that keeps
        failing gives up ``deadline_s`` after its first attempt (default: ``$FSDP_OPTIM_STORE_DEADLINE_S`` or 60)."""
        from fsspec.core import url_to_fs  # (a requirement; imported only for a URL)

        policy = RetryPolicy.default(deadline_s)
        try:
            fs, root = url_to_fs(url, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            scheme = url.split("://", 1)[0]
            hint = " (pip install 'fsdp_optim[s3]' for s3://)" if scheme in ("s3", "s3a") else ""
            raise ValueError(f"{url}: no filesystem for the scheme '{scheme}'{hint}: {exc}") from None
        return cls(url, fs, root, policy)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectStore) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def parent(self) -> ObjectStore:
        return ObjectStore(self.url.rsplit("/", 1)[0], self.fs, self.root.rsplit("/", 1)[0], self.policy)

    def child(self, name: str) -> ObjectStore:
        return ObjectStore(f"{self.url}/{name}", self.fs, self.key(name), self.policy)

    # -- reading ----------------------------------------------------------------------------------------------

    def read_range(self, name: str, start: int, stop: int) -> bytes | bytearray:
        """One ranged GET (pieces above 16 MiB); ``FileNotFoundError`` at once for a missing object."""
        if stop <= start:
            return b""
        if stop - start > PIECE_BYTES:  # large: pieces fetched concurrently, each retried on its own
            out = bytearray(stop - start)  # writable: readers wrap it without another copy
            self.read_into(name, start, [memoryview(out)])
            return out
        return self._read_one(name, start, stop, self.policy.clock())

    def _read_one(self, name: str, start: int, stop: int, clock: Clock) -> bytes:
        """One ranged GET of ``[start, stop)``, retried on transient errors and short bodies until ``clock``."""

        def get(limit: dict[str, float]) -> bytes:
            data = bytes(self.fs.cat_file(self.key(name), start=start, end=stop, **limit))
            if len(data) != stop - start:
                raise _ShortBody(f"{len(data)} of {stop - start} bytes")
            return data

        return self._retry(get, f"{self / name}: reading bytes {start}..{stop}", clock=clock, nbytes=stop - start)

    def read_into(self, name: str, start: int, targets: Sequence[memoryview]) -> None:
        """Ranged GETs of 16 MiB pieces, at most 8 in flight, each copied once into the buffers it covers; a piece
        that failed or came back short is fetched again on its own."""
        stop = start + sum(t.nbytes for t in targets)
        bounds = [(a, min(a + PIECE_BYTES, stop)) for a in range(start, stop, PIECE_BYTES)]
        place, clock = Tiling(start, targets), self.policy.clock()  # one deadline for all the pieces
        for first in range(0, len(bounds), MAX_CONCURRENT):  # bounded: at most MAX_CONCURRENT pieces in flight
            batch = bounds[first : first + MAX_CONCURRENT]
            limit = self._limit(clock, max(b - a for a, b in batch))
            try:
                got = self.fs.cat_ranges(
                    [self.key(name)] * len(batch), [a for a, _ in batch], [b for _, b in batch], on_error="return",
                    **limit,
                )  # fmt: skip
            except Exception as exc:  # the whole batch failed: each piece on its own, with retries
                if refused(exc):
                    raise PermissionError(refused_message(f"{self / name}", describe(exc))) from exc
                got = [None] * len(batch)
            for (a, b), data in zip(batch, got):
                if not isinstance(data, (bytes, bytearray)) or len(data) != b - a:
                    if isinstance(data, FileNotFoundError):
                        raise FileNotFoundError(f"{self / name}: no such object") from None
                    data = self._read_one(name, a, b, clock)
                place.copy(a, data)

    @contextmanager
    def prefetch(self, spans: Callable[[], Sequence[SpanLike]]) -> Iterator[dict[str, list[StorePiece]]]:
        with StorePrefetch(self, spans()) as ahead:
            yield ahead.by_file()

    def download(self, name: str, local: Path, *, size: int) -> None:
        """One GET, retried as a whole."""
        fetch = lambda limit: self.fs.get_file(self.key(name), str(local), **limit)  # noqa: E731
        self._retry(fetch, f"{self / name}: downloading it", nbytes=size)

    def _info(self, name: str, what: str) -> dict[str, Any] | None:
        """What the filesystem says of object ``name`` now (not cached); ``None`` when there is none."""

        def info(limit: dict[str, float]) -> dict[str, Any] | None:
            try:
                self.fs.invalidate_cache(self.key(name))
                return dict(self.fs.info(self.key(name), **limit))
            except FileNotFoundError:
                return None

        return self._retry(info, f"{self / name}: {what}")

    def size(self, name: str) -> int | None:
        info = self._info(name, "asking its size")
        return None if info is None else int(info["size"])

    def _entries(self) -> list[dict[str, Any]]:
        """What the filesystem lists directly under this prefix now (not cached), by name; [] when nothing."""

        def ls(limit: dict[str, float]) -> list[dict[str, Any]]:
            self.fs.invalidate_cache(self.root)
            try:
                return list(self.fs.ls(self.root, detail=True, **limit))
            except FileNotFoundError:
                return []

        return self._retry(ls, f"{self}: listing it")

    def listing(self) -> dict[str, StoredObject]:
        found = {}
        for e in self._entries():
            if e.get("type") == "directory" or str(e["name"]).endswith("/"):  # a prefix, or a directory marker
                continue
            name, size = str(e["name"]).rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0)
            found[name] = StoredObject(name, size, mtime_of(e), etag_of(e) or f"size:{size}")  # as etag() has it
        return found

    def prefixes(self) -> list[str]:
        names = (str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in self._entries() if e.get("type") == "directory")
        return sorted(names)

    def removal(self, *, purpose: str) -> AbstractContextManager[Callable[[], None]]:  # noqa: ARG002 - no lock
        """No lock; the call removes the empty "directory" object some stores keep for an emptied prefix."""
        return nullcontext(self._remove_marker)

    def _remove_marker(self) -> None:
        with contextlib.suppress(Exception):  # nothing there, or a store that does not allow it: it stays listed
            self.fs.rm_file(self.root + "/")
        self.fs.invalidate_cache(self.root)
        if "/" in self.root.strip("/"):  # a prefix inside a bucket or directory (never a bucket itself)
            with contextlib.suppress(Exception):  # not empty, not there, or not a directory: nothing to remove
                self.fs.rmdir(self.root)  # where empty directories are kept (memory://, file://); on S3 a no-op
            self.fs.invalidate_cache(self.root)

    # -- writing ----------------------------------------------------------------------------------------------

    def write(self, name: str, data: bytes | Path) -> None:
        """Object ``name`` put whole from bytes or a local file (multipart above the filesystem's block size)."""
        if isinstance(data, Path):
            what, nbytes = f"{self / name}: uploading {data}", data.stat().st_size
            self._retry(lambda limit: self.fs.put_file(str(data), self.key(name), **limit), what, nbytes=nbytes)
        else:
            what, nbytes = f"{self / name}: writing {len(data)} bytes", len(data)
            self._retry(lambda limit: self.fs.pipe_file(self.key(name), data, **limit), what, nbytes=nbytes)

    def multipart(self, name: str) -> S3Multipart | None:
        """Where the filesystem is S3's."""
        if type(self.fs).__name__ != "S3FileSystem":
            return None
        return S3Multipart(self.fs, self.key(name), str(self / name), self._retry)

    def etag(self, name: str) -> str | None:
        info = self._info(name, "asking its etag")
        return None if info is None else etag_of(info) or f"size:{info.get('size')}"

    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None:
        """On S3 one conditional put (412 when another writer won); elsewhere a check, then a write (the module
        docstring)."""
        where = self / name
        if self.conditional:
            match = {"IfNoneMatch": "*"} if replaces is None else {"IfMatch": replaces}
            try:
                self.fs.pipe_file(self.key(name), data, **match, **self._limit(self.policy.clock(), len(data)))
            except Exception as exc:
                if refused(exc):
                    raise PermissionError(refused_message(f"{where}: committing the manifest", describe(exc))) from exc
                self.fs.invalidate_cache(self.key(name))
                # The put may have been stored with its response lost: on a retry it meets its own object (a 412 that
                # is a success), and with every response lost the client gives up on a put that is in place. What is
                # there now says which; when that cannot be read either, nobody knows (and nothing may be removed).
                try:
                    size = self.size(name)
                    landed = size == len(data) and self.read_range(name, 0, size) == data
                except Exception as check:
                    raise CommitOutcomeUnknown(
                        f"{where}: committing the manifest failed ({describe(exc)}) and it could not be read back "
                        f"({describe(check)}): it may be in place, so this save's files are kept"
                    ) from exc
                if landed:
                    self.fs.invalidate_cache(self.key(name))
                    return
                if precondition_failed(exc):
                    raise ConcurrentCommitError(_lost(where, replaces)) from None
                raise OSError(f"{where}: committing the manifest failed: {describe(exc)}") from exc
            self.fs.invalidate_cache(self.key(name))
            return
        if self.etag(name) != replaces:
            raise ConcurrentCommitError(_lost(where, replaces))
        self.write(name, data)

    def delete(self, names: Iterable[str]) -> None:
        for key in [self.key(n) for n in names]:
            try:
                self._retry(lambda limit, k=key: self.fs.rm_file(k, **limit), f"{self}: deleting {key}")  # type: ignore[misc]
            except FileNotFoundError:
                pass

    # -- retries ----------------------------------------------------------------------------------------------

    def _limit(self, clock: Clock, nbytes: int = 0) -> dict[str, float]:
        """The keyword that cuts one call at ``clock`` (an asynchronous filesystem's), else none."""
        return {"timeout": clock.timeout(nbytes)} if self._timed else {}

    def _retry(
        self, call: Callable[[dict[str, float]], T], what: str, *, clock: Clock | None = None, nbytes: int = 0
    ) -> T:
        """``call(limit)``, again after a backoff on a transient error, at most ``policy.attempts`` times and never
        past ``clock`` (the policy's deadline from now by default); ``limit`` is the keyword that cuts the call at the
        deadline (plus ``nbytes``' transfer). A missing object, a lost conditional put and refused credentials are
        answers, not transient: raised at once."""
        clock = clock or self.policy.clock()
        began = time.monotonic()
        for attempt in range(self.policy.attempts):
            try:
                return call(self._limit(clock, nbytes))
            except (FileNotFoundError, ConcurrentCommitError, CommitOutcomeUnknown, StoreUnavailable):
                raise
            except Exception as exc:  # 5xx, SlowDown, reset connections, short bodies: all worth another try
                if refused(exc):
                    raise PermissionError(refused_message(what, describe(exc))) from exc
                if precondition_failed(exc):  # an answer: the object is not as the request required
                    raise OSError(f"{what}: {describe(exc)}") from exc
                pause = self.policy.backoff_s * 2**attempt
                if attempt == self.policy.attempts - 1 or clock.left() <= pause:
                    spent = time.monotonic() - began
                    why = "" if clock.left() > pause else f", at {self.policy.describe(nbytes)}"
                    raise StoreUnavailable(
                        f"{what}: failed after {attempt + 1} attempt{'s' if attempt else ''} in {spent:.1f} s{why}: "
                        f"{describe(exc)}"
                    ) from exc
                time.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")


class _ShortBody(OSError):
    """A ranged GET that returned fewer bytes than asked (a connection cut mid-body)."""


def _lost(where: object, replaces: str | None) -> str:
    found = "one appeared" if replaces is None else "it changed"
    return (
        f"{where}: another writer committed this checkpoint while this save ran ({found} since this save began); "
        "this save committed nothing and removed its own files"
    )
