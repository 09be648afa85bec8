"""What an object store's answers mean, for :mod:`.storage`: a failed precondition (412, however the client wraps
it), an error in a line, an entry's modification time and etag; and :class:`Tiling`, the buffers a ranged read of
pieces fills."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Tiling", "describe", "etag_of", "mtime_of", "precondition_failed"]


class Tiling:
    """Buffers tiling the bytes from ``start`` on: :meth:`copy` puts bytes at an offset into those they cover."""

    def __init__(self, start: int, targets: Sequence[memoryview]) -> None:
        self.targets = [t.cast("B") if t.format != "B" or t.ndim != 1 else t for t in targets]
        self.starts = list(itertools.accumulate((t.nbytes for t in self.targets), initial=start))

    def copy(self, at: int, data: bytes | bytearray) -> None:
        k = max(bisect.bisect_right(self.starts, at) - 1, 0)
        done = 0
        while done < len(data):
            target, lo = self.targets[k], at + done - self.starts[k]
            n = min(len(data) - done, target.nbytes - lo)
            target[lo : lo + n] = data[done : done + n]
            done, k = done + n, k + 1


def precondition_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it: s3fs reports some stores' 412 as ``OSError(EINVAL)`` from a botocore
    ``ClientError``) is a failed precondition of a conditional put."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            error = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") == "PreconditionFailed" or status == 412:
                return True
        if isinstance(exc, FileExistsError) or "PreconditionFailed" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def describe(exc: BaseException) -> str:
    """The error as one short line; a timeout that says nothing (fsspec's ``FSTimeoutError``) says what it means."""
    text = str(exc)[:300].strip()
    if not text and isinstance(exc, TimeoutError):
        text = "no answer before the attempt's time was up (a store that is down, unreachable or not answering)"
    return f"{type(exc).__name__}: {text}"


def mtime_of(entry: Mapping[str, Any]) -> float | None:
    value = entry.get("LastModified", entry.get("mtime", entry.get("created")))
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def etag_of(entry: Mapping[str, Any]) -> str | None:
    value = entry.get("ETag") or entry.get("etag")
    return str(value) if value else None
