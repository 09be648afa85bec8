"""``consolidate -o s3://bucket/x/model.safetensors``: the one safetensors file
(:mod:`fsdp_optim.offline.onefile_layout`) written straight into an object store as the parts of ONE multipart
upload (:mod:`fsdp_optim.disk.multipart`), never whole on a local disk. The same layout, so the same bytes as the
local file::

    plan     lay_out; the parts: core/split.plan_parts (process 0's first part holds the header's room)
    begin    the object refused if present (unless overwrite), one upload begun
    write    each tensor made, hashed, its bytes fed into the current part's buffer; a full part is put (the part
             that holds the header's room is held instead), then the next
    commit   the header with every checksum written into the held part, which is put; the upload completed with
             every part: the object appears whole, at once

A failure at any step aborts the upload: no object appears. Memory: one tensor and one part buffer (64 MiB), and
the held first part. Under ``torchrun`` each process writes its own parts (:mod:`fsdp_optim.offline.parallel.onefile`).
A store without multipart uploads gets the file written locally and uploaded whole (``offline/publish.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_optim.core.split import PartPlan, PartSpan, plan_parts
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.multipart import Multipart, Part
from fsdp_optim.disk.save import Begun, Save, Staging, Writer
from fsdp_optim.offline.onefile_layout import FileLayout, final_header, made

__all__ = ["Share", "UploadSink", "upload_sink", "write_parts"]


@dataclass
class Share:
    """What one process wrote: its tensors' checksums by name, its parts put, and the parts it holds (the header's)."""

    sums: dict[str, Any] = field(default_factory=dict)
    parts: list[Part] = field(default_factory=list)
    held: dict[int, tuple[PartSpan, bytearray]] = field(default_factory=dict)


class _Parts:
    """Bytes fed in file order from the first part's start, cut at the parts' bounds: each full part put, or held
    (the parts that overlap the header's room, ``held_below`` bytes)."""

    def __init__(
        self, spans: Sequence[PartSpan], put: Callable[[PartSpan, bytearray], Part], held_below: int, share: Share
    ) -> None:  # noqa: D107
        self.spans, self.put, self.held_below, self.share = list(spans), put, held_below, share
        self.k, self.filled = 0, 0
        self.buffer = bytearray(self._len()) if self.spans else bytearray()

    def _len(self) -> int:
        return self.spans[self.k].stop - self.spans[self.k].start

    def feed(self, data: memoryview) -> None:
        at = 0
        while at < len(data):
            step = min(len(data) - at, len(self.buffer) - self.filled)
            self.buffer[self.filled : self.filled + step] = data[at : at + step]
            at, self.filled = at + step, self.filled + step
            if self.filled == len(self.buffer):
                self._done()

    def _done(self) -> None:
        span = self.spans[self.k]
        if span.start < self.held_below:
            self.share.held[span.number] = (span, self.buffer)
        else:
            self.share.parts.append(self.put(span, self.buffer))
        self.k, self.filled = self.k + 1, 0
        self.buffer = bytearray(self._len()) if self.k < len(self.spans) else bytearray()

    def close(self) -> None:
        if self.k != len(self.spans) or self.filled:
            raise RuntimeError(
                f"consolidate: {self.k} of {len(self.spans)} parts filled: the tensors' bytes do not tile them"
            )


def write_parts(
    layout: FileLayout, plan: PartPlan, rank: int, upload: Multipart, upload_id: str, *, after: Callable[[int], None]
) -> Share:  # fmt: skip
    """Process ``rank``'s tensors of ``plan`` made, hashed and put as its parts (process 0's first bytes: the header's
    room, held for the commit). ``after(nbytes)`` runs after each tensor."""
    share = Share()
    spans = plan.parts[rank]
    room = layout.offsets[0] if layout.offsets else layout.size  # the header's
    parts = _Parts(spans, lambda s, data: upload.put_part(upload_id, s.number, data), room, share)
    if spans and spans[0].start == 0:
        parts.feed(memoryview(bytes(room)))  # zeros: the header is written there at the commit
    for i in plan.runs[rank]:
        parts.feed(made(layout.tensors[i], share.sums))  # (freed before the next)
        after(layout.tensors[i].nbytes)
    parts.close()
    return share


class UploadSink(Writer):
    """The parts of one multipart upload of ``output`` (``upload``), the sink of the one file
    (:class:`~fsdp_optim.offline.onefile.Sink`) and the writer of its save: process 0 refuses an object there (unless
    ``overwrite``) and begins the upload (its id sent); each process puts the parts of its run; process 0 holds the
    part with the header's room, and its commit writes the header into it, puts it and completes the upload with
    every part: the object appears whole, at once. An abort (process 0) aborts the upload: no object appears."""

    def __init__(self, layout: FileLayout, plan: PartPlan, output: str, store: Location, upload: Multipart,
                 inputs: Sequence[Any]) -> None:  # fmt: skip  # noqa: D107
        self.layout, self.plan, self.output, self.upload, self.inputs = layout, plan, output, upload, inputs
        self.location, self.writer = store, self
        self.target = ""  # the upload's id
        self.parts: list[Part] = []  # process 0's at the commit: every part put
        self.held: list[tuple[PartSpan, bytearray]] = []

    def begin(self, *, purpose: str, overwrite: bool) -> Begun:  # noqa: ARG002 - nothing held
        if any(str(i).rstrip("/") == self.output for i in self.inputs if i is not None):
            raise ValueError(f"output: {self.output} is also an input; write to another place")
        if not overwrite and self.location.size(self.output.rsplit("/", 1)[1]) is not None:
            raise FileExistsError(f"output: {self.output}: an object is there already; pass --overwrite to replace it")
        self.target = self.upload.begin()
        return Begun(None)

    def open(self, save: Save) -> str:  # noqa: ARG002 - begun: the upload's id
        return self.target

    def write(self, rank: int, after: Callable[[int], None]) -> Share:
        return write_parts(self.layout, self.plan, rank, self.upload, self.target, after=after)

    def sent(self, share: Share) -> Share:
        return Share(share.sums, share.parts)  # the held part stays on process 0

    def header(self, mine: Share, shares: Sequence[Share]) -> bytes:
        self.held, self.parts = list(mine.held.values()), [p for s in shares for p in s.parts]
        return final_header(self.layout, [share.sums for share in shares])

    def commit(self, begun: Begun | None, data: bytes | None) -> None:  # noqa: ARG002 - the upload is the hold
        if data is None:
            return
        for span, buffer in self.held:
            piece = data[span.start : span.stop]
            buffer[: len(piece)] = piece
        held = [self.upload.put_part(self.target, span.number, buffer) for span, buffer in self.held]
        self.upload.complete(self.target, [*held, *self.parts])

    def finish(self, begun: Begun | None, *, keep: frozenset[str]) -> None:
        """Nothing left to do: the completed upload is the object."""

    def abort(self, begun: Begun | None, staging: Staging, names: Sequence[str]) -> None:  # noqa: ARG002
        """The upload aborted, where this process began it (a failure to abort ignored: the failure that brought
        the driver here is the one told; an upload never completed leaves no object)."""
        if begun is not None:
            with contextlib.suppress(Exception):
                self.upload.abort(self.target)


def upload_sink(
    layout: FileLayout, runs: Sequence[Sequence[int]], output: str, *, inputs: Sequence[Any], part_bytes: int
) -> UploadSink | None:
    """The multipart sink of ``output`` (:class:`UploadSink`), ``None`` where its store takes no multipart uploads."""
    output = output.rstrip("/")
    store = where(output.rsplit("/", 1)[0])
    upload = store.multipart(output.rsplit("/", 1)[1])
    plan = plan_parts(layout.offsets, [t.nbytes for t in layout.tensors], layout.size, runs, part_bytes=part_bytes)
    return None if upload is None else UploadSink(layout, plan, output, store, upload, inputs)
