"""Bytes written to a file and hashed at the same time, on two threads: a save pays the slower of the two, not both.

A file's ``write`` and xxhash's ``update`` both release the GIL while they work on a large buffer, so a writer
thread can push piece ``k`` to the file while the caller hashes the same piece. The piece is done (its memory may be
reused, e.g. a staging ring's slot) once both are: :meth:`HashingWriter.put` returns only then. Smaller pieces than
:data:`OVERLAP_BYTES` are written and hashed in turn on the caller's thread, where a thread's hand-off would cost more
than it saves: it saves at most the piece's hash (xxh3: about 0.1 ms a MiB), and costs two to three context switches
(on a busy machine each waits for a core) and, for 1-2.5 MiB pieces, about 20% more CPU time for the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import BinaryIO

__all__ = ["OVERLAP_BYTES", "HashingWriter"]

OVERLAP_BYTES = 8 << 20  # pieces smaller than this are written and hashed in turn (a host rank file's whole pieces)


class HashingWriter:
    """Writes pieces to ``file`` (at its position, in order) while the caller's thread hashes them.

    Use as a context manager: its writer thread lives as long as the ``with`` block."""

    def __init__(self, file: BinaryIO, *, overlap_bytes: int = OVERLAP_BYTES) -> None:
        self.file = file
        self.overlap_bytes = overlap_bytes
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> HashingWriter:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_optim-write")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None

    def put(self, raw: memoryview, hash_update: Callable[[memoryview], object]) -> None:
        """Write ``raw`` to the file and feed it to ``hash_update``, both done when this returns (the write's error,
        if any, is raised here; a hashing error is raised once the write has finished with ``raw``)."""
        if self._pool is None or len(raw) < self.overlap_bytes:
            _write_all(self.file, raw)
            hash_update(raw)
            return
        pending = self._pool.submit(_write_all, self.file, raw)
        try:
            hash_update(raw)
        finally:
            pending.result()  # raw's memory is the caller's again only once the write is done with it


def _write_all(file: BinaryIO, raw: memoryview) -> None:
    """``file.write(raw)``, all of it (a raw, unbuffered file may take part of a large write)."""
    done = 0
    while done < len(raw):
        wrote = file.write(raw[done:])
        if wrote is None or wrote <= 0:
            raise OSError(f"{getattr(file, 'name', 'the file')}: a write took no bytes ({done} of {len(raw)} written)")
        done += wrote
