"""One object written as the parts of one multipart upload: the S3 calls, kept here (``disk/``), behind four methods.

An upload is begun once (its id), its parts are put by any number of processes (each part one request, any order),
and the object appears only when the upload is completed with every part's number and etag; an aborted upload
leaves no object and frees its parts. Before completion nothing is visible under the key, so a writer killed
anywhere leaves no object (an upload nobody completes or aborts keeps its parts until the bucket's lifecycle rule
``AbortIncompleteMultipartUpload`` removes them)::

    upload = where("s3://bucket/x").multipart("model.safetensors")   # None: the backend has no such API
    upload_id = upload.begin()
    part = upload.put_part(upload_id, 2, data)        # any process; Part(2, etag), the etag checked against md5
    upload.complete(upload_id, [part1, part, ...])    # one process, once every part is in
    upload.abort(upload_id)                            # after a failure

Each call is retried on transient errors under the store's policy (:meth:`ObjectStore._retry`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Multipart", "Part", "S3Multipart"]

Retry = Callable[..., Any]  # ObjectStore._retry: (call(limit), what, *, nbytes) -> call's result
_MD5 = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Part:
    """A part put: its number and the etag the store answered (what completion names it by)."""

    number: int
    etag: str


class Multipart(Protocol):
    """One object's multipart upload (module docstring)."""

    def begin(self) -> str: ...
    def put_part(self, upload_id: str, number: int, data: bytes | bytearray | memoryview) -> Part: ...
    def complete(self, upload_id: str, parts: Sequence[Part]) -> None: ...
    def abort(self, upload_id: str) -> None: ...


class S3Multipart:
    """:class:`Multipart` through s3fs's client: object ``path`` (``bucket/key``), ``where`` its URL."""

    def __init__(self, fs: Any, path: str, where: str, retry: Retry) -> None:  # noqa: D107
        self.fs, self.where, self.retry = fs, where, retry
        self.bucket, self.key, _ = fs.split_path(path)

    def _call(self, method: str, what: str, nbytes: int = 0, **kwargs: Any) -> Any:
        call = lambda limit: self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs, **limit)  # noqa: E731
        return self.retry(call, f"{self.where}: {what}", nbytes=nbytes)

    def begin(self) -> str:
        return str(self._call("create_multipart_upload", "beginning a multipart upload")["UploadId"])

    def put_part(self, upload_id: str, number: int, data: bytes | bytearray | memoryview) -> Part:
        """Put part ``number``; ``OSError`` when the etag answered is an md5 other than the bytes sent."""
        body = bytes(data)
        answer = self._call("upload_part", f"putting part {number} ({len(body)} bytes)", len(body),
                            UploadId=upload_id, PartNumber=number, Body=body)  # fmt: skip
        etag = str(answer["ETag"])
        sent = hashlib.md5(body, usedforsecurity=False).hexdigest()
        if _MD5.match(etag.strip('"')) and etag.strip('"') != sent:
            raise OSError(
                f"{self.where}: part {number}: the store holds other bytes (md5 {etag}) than were sent ({sent})"
            )
        return Part(number, etag)

    def complete(self, upload_id: str, parts: Sequence[Part]) -> None:
        listed = [{"PartNumber": p.number, "ETag": p.etag} for p in sorted(parts, key=lambda p: p.number)]
        self._call("complete_multipart_upload", f"completing the upload of {len(listed)} parts",
                   UploadId=upload_id, MultipartUpload={"Parts": listed})  # fmt: skip
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")

    def abort(self, upload_id: str) -> None:
        self._call("abort_multipart_upload", "aborting the upload", UploadId=upload_id)
