"""Byte ranges of a location's objects fetched ahead of the reader that uses them, a bounded window at a time:
:meth:`ObjectStore.prefetch <fsdp_optim.disk.storage.ObjectStore.prefetch>` (any location read by ranged reads).

A load at another world size reads many small ranges of several rank files
(:func:`~fsdp_optim.formats.sharded.byte_ranges.load_spans` lists them from the plans alone, in order of use). One
GET after another, each would wait for a round trip; here they are fetched in that order by a pool of
``MAX_CONCURRENT`` threads (16 MiB pieces), at most ``window`` bytes fetched and not yet used up::

    spans (in order of use):   [h0] [h1] [a 2 MiB] [b 3 MiB] [c 40 MiB] [d 1 MiB] ...
    window 128 MiB:             fetched ------------------------------ > waits for a, b ... to be used up

A load reads each :class:`StorePiece` as part of a :class:`~fsdp_optim.formats.sharded.sources.HeldSource`, so every
byte is verified as a file's are before it is used; a piece drops its bytes after its last shard read (``uses``,
counted by the plan). Memory: the rank's own shards plus at most ``window`` bytes plus the ranges being read. A
piece is fetched at once (beyond the window) when the load needs it, and again if needed after it was dropped, so a
count that is wrong costs a fetch, never a wrong byte. Errors (a missing object, a store gone after its retries) are
raised where the load reads the piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from fsdp_optim.disk.location import Location
from fsdp_optim.disk.store_policy import MAX_CONCURRENT, PIECE_BYTES

__all__ = ["WINDOW_BYTES", "SpanLike", "StorePiece", "StorePrefetch"]


class SpanLike(Protocol):
    """Bytes ``[start, stop)`` of object ``file`` that a reader reads, ``uses`` times (0: kept until the end)."""

    @property
    def file(self) -> str: ...

    @property
    def start(self) -> int: ...

    @property
    def stop(self) -> int: ...

    @property
    def uses(self) -> int: ...


WINDOW_BYTES = 128 << 20  # fetched ahead of the load and not yet used up


class StorePiece:
    """Bytes ``[start, stop)`` of object ``name``, fetched by its :class:`StorePrefetch`; ``uses`` shard reads left
    (0: kept until the load ends: a header, a side file)."""

    def __init__(self, owner: StorePrefetch, span: SpanLike) -> None:  # noqa: D107 - see the class
        self.owner, self.name, self.start, self.stop, self.uses = owner, span.file, span.start, span.stop, span.uses
        self.data: torch.Tensor | None = None
        self.futures: list[Future[None]] = []
        self.fetched = 0  # times its bytes were fetched

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    @property
    def dropped(self) -> bool:
        return self.fetched > 0 and self.data is None

    def bytes(self) -> torch.Tensor:
        # Not fetched yet (the load outran the window), or dropped and needed again: fetched now.
        data = self.data if self.data is not None else self.owner.fetch(self)
        futures, self.futures = self.futures, []
        try:
            for f in futures:
                f.result()  # its error (the store's, after its retries) is raised here, where the load reads
        except BaseException:
            self.owner.forget(self)  # (fetched again if read again)
            raise
        self.owner.top_up()
        return data

    def used(self) -> None:
        if self.uses > 0:
            self.uses -= 1
            if self.uses == 0:
                self.owner.drop(self)


class StorePrefetch:
    """Fetches ``spans`` of ``store``'s objects in order, ``window`` bytes ahead of their use (a context manager:
    leaving it waits for what is in flight and lets every byte go)."""

    def __init__(self, store: Location, spans: Sequence[SpanLike], window: int = WINDOW_BYTES) -> None:  # noqa: D107
        self.store, self.window = store, window
        self.pieces = [StorePiece(self, s) for s in spans]
        self.held = 0  # bytes fetched or in flight and not dropped
        self.bytes_fetched = 0
        self._next = 0
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT, thread_name_prefix="fsdp-optim-prefetch")
        self.top_up()

    def __enter__(self) -> StorePrefetch:
        return self

    def __exit__(self, *_: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for piece in self.pieces:
            piece.data, piece.futures = None, []
        self.held = 0

    def by_file(self) -> dict[str, list[StorePiece]]:
        """The pieces, by object name."""
        by_file: dict[str, list[StorePiece]] = {}
        for piece in self.pieces:
            by_file.setdefault(piece.name, []).append(piece)
        return by_file

    def top_up(self) -> None:
        """Start fetching the next pieces in order while what is held stays within the window (one at least)."""
        while self._next < len(self.pieces):
            piece = self.pieces[self._next]
            if piece.fetched == 0:
                if self.held and self.held + piece.nbytes > self.window:
                    return
                self.fetch(piece)
            self._next += 1

    def fetch(self, piece: StorePiece) -> torch.Tensor:
        """Start fetching ``piece`` (16 MiB at a time, on the pool) into memory of its own, which is returned."""
        piece.data = data = torch.empty(piece.nbytes, dtype=torch.uint8)
        piece.fetched += 1
        self.held += piece.nbytes
        self.bytes_fetched += piece.nbytes
        raw = data.numpy().data
        for a in range(0, piece.nbytes, PIECE_BYTES):
            part = raw[a : a + PIECE_BYTES]
            piece.futures.append(self._pool.submit(self.store.read_into, piece.name, piece.start + a, [part]))
        return data

    def drop(self, piece: StorePiece) -> None:
        """Let ``piece``'s bytes go (its last shard read is done) and fetch further ahead."""
        if piece.data is not None and not piece.futures:
            self.forget(piece)
            self.top_up()

    def forget(self, piece: StorePiece) -> None:
        for f in piece.futures:
            f.cancel()
        piece.futures = []
        if piece.data is not None:
            piece.data = None
            self.held -= piece.nbytes
