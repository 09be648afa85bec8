"""How long a store may keep failing before a request gives up, and what a store's answers mean (refused
credentials, a failed precondition, an entry's time and etag), for :mod:`.storage`.

A request (one GET, one put, one listing, or the pieces of one ranged read together) is tried at most
:data:`ATTEMPTS` times with backoff, and never past its **deadline**: :data:`DEFAULT_DEADLINE_S` seconds from its
first attempt unless ``FSDP_OPTIM_STORE_DEADLINE_S`` or ``open_store(url, deadline_s=...)`` says otherwise. Each
attempt of an asynchronous filesystem (s3fs, gcsfs...) is cut at the time left, so the client's own retries inside
it (botocore's, s3fs's) cannot outlast it either; a transfer is allowed its bytes at :data:`TRANSFER_FLOOR` bytes a
second on top, so a large upload that is making progress is not cut. A store that keeps failing therefore fails
every request within the deadline (plus one transfer's allowance, which the message states), naming the object. A
save that fails so then spends at most one more deadline removing what this rank uploaded, and a commit whose answer
was lost one more asking the store whether it landed. The deadline bounds the store's requests, not a command's own
start (Python, torch) and exit.

Refused access (a 403, a wrong key or signature, no credentials at all) is an answer, not a fault: it is raised at
once as a ``PermissionError`` that names the object and says where credentials come from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ATTEMPTS",
    "BACKOFF_S",
    "DEADLINE_ENV",
    "DEFAULT_DEADLINE_S",
    "Clock",
    "RetryPolicy",
    "describe",
    "etag_of",
    "mtime_of",
    "precondition_failed",
    "refused",
    "refused_message",
]

PIECE_BYTES = 16 << 20  # a large range is fetched as pieces of this size ...
MAX_CONCURRENT = 8  # ... at most this many at a time (bounded memory and connections)
ATTEMPTS = 3  # per request, on transient errors (s3fs and botocore retry inside each attempt as well)
BACKOFF_S = 0.2
DEFAULT_DEADLINE_S = 60.0
DEADLINE_ENV = "FSDP_OPTIM_STORE_DEADLINE_S"
TRANSFER_FLOOR = 4 << 20  # bytes a second a transfer is allowed beyond the deadline (a slow link, not a dead one)
MIN_ATTEMPT_S = 1.0  # the least an attempt is given, even when the deadline is (nearly) spent

# Answers that mean "not with these credentials": botocore's error codes and the exceptions it raises before a
# request is sent (no credentials found at all).
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "AccountProblem",
        "AllAccessDisabled",
    }
)
_REFUSED_TYPES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``attempts`` tries of a request, ``backoff_s`` doubling between them, none past ``deadline_s``."""

    deadline_s: float
    attempts: int = ATTEMPTS
    backoff_s: float = BACKOFF_S

    @classmethod
    def default(cls, deadline_s: float | None = None) -> RetryPolicy:
        """``deadline_s``, else ``$FSDP_OPTIM_STORE_DEADLINE_S``, else :data:`DEFAULT_DEADLINE_S`."""
        if deadline_s is None:
            text = os.environ.get(DEADLINE_ENV, "").strip()
            if not text:
                return cls(DEFAULT_DEADLINE_S)
            try:
                deadline_s = float(text)
            except ValueError:
                raise ValueError(f"{DEADLINE_ENV}: expected a number of seconds, found {text!r}") from None
            where = DEADLINE_ENV
        else:
            where = "deadline_s"
        if not deadline_s > 0 or deadline_s == float("inf"):
            raise ValueError(f"{where}: expected a positive, finite number of seconds, found {deadline_s!r}")
        return cls(float(deadline_s))

    def clock(self) -> Clock:
        """The time left to one request, from now."""
        return Clock(time.monotonic() + self.deadline_s)

    def describe(self, nbytes: int = 0) -> str:
        """The deadline a request gave up at, and the allowance its transfer of ``nbytes`` had beyond it."""
        allowance = nbytes / TRANSFER_FLOOR
        beyond = (
            f", plus {allowance:.1f} s allowed for its {nbytes / (1 << 20):.1f} MiB transfer at "
            f"{TRANSFER_FLOOR >> 20} MiB/s"
            if allowance >= 0.05
            else ""
        )
        return f"the store deadline, {self.deadline_s:g} s{beyond} ({DEADLINE_ENV} or open_store(url, deadline_s=...))"


@dataclass(frozen=True)
class Clock:
    """One request's deadline (shared by the pieces of one ranged read)."""

    until: float

    def left(self) -> float:
        return self.until - time.monotonic()

    def timeout(self, nbytes: int = 0) -> float:
        """How long one attempt may run: the time left (at least :data:`MIN_ATTEMPT_S`) plus its transfer's share."""
        return max(self.left(), MIN_ATTEMPT_S) + nbytes / TRANSFER_FLOOR


def _chain(exc: BaseException | None) -> Iterator[tuple[BaseException, Any, Any]]:
    """``exc`` and what caused it (8 at most), each with its botocore answer's error code and HTTP status."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            yield exc, response.get("Error", {}).get("Code"), response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        else:
            yield exc, None, None
        exc, seen = exc.__cause__ or exc.__context__, seen + 1


def refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is the store refusing these credentials: a 401/403, a wrong key or
    signature, or no credentials found at all."""
    return any(
        isinstance(e, PermissionError) or {t.__name__ for t in type(e).__mro__} & _REFUSED_TYPES
        or code in _REFUSED_CODES or status in (401, 403)
        for e, code, status in _chain(exc)
    )  # fmt: skip


def precondition_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it: s3fs reports some stores' 412 as ``OSError(EINVAL)`` from a botocore
    ``ClientError``) is a failed precondition of a conditional put."""
    return any(
        code == "PreconditionFailed" or status == 412 or isinstance(e, FileExistsError)
        or "PreconditionFailed" in str(e) for e, code, status in _chain(exc)
    )  # fmt: skip


def refused_message(what: str, detail: str) -> str:
    return (
        f"{what}: the store refused access ({detail}): check the credentials and that they may use this bucket "
        "(for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the AWS config files, or "
        "open_store(url, key=..., secret=...)), and the endpoint (AWS_ENDPOINT_URL)"
    )


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
