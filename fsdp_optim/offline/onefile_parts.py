"""``consolidate -o s3://bucket/x/model.safetensors``: the one safetensors file
(:mod:`fsdp_optim.offline.onefile_layout`) written straight into an object store as the parts of ONE multipart
upload (:mod:`fsdp_optim.disk.multipart`), never whole on a local disk. The same layout, so the same bytes as the
local file::

    plan     lay_out; the parts: core/parts.plan_parts (process 0's first part holds the header's room)
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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fsdp_optim.core.parts import PART_BYTES, PartPlan, PartSpan, plan_parts
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.multipart import Multipart, Part
from fsdp_optim.formats.named_safetensors.writer import tensor_checksums
from fsdp_optim.offline.onefile_layout import FileLayout, final_header, stepped

if TYPE_CHECKING:
    from fsdp_optim.job.team import Team

__all__ = ["Share", "UploadSink", "abort_quietly", "commit_parts", "layout_parts", "open_upload", "to_upload",
           "write_parts"]


@dataclass
class Share:
    """What one process wrote: its tensors' checksums by name, its parts put, and the parts it holds (the header's)."""

    sums: dict[str, Any] = field(default_factory=dict)
    parts: list[Part] = field(default_factory=list)
    held: dict[int, tuple[PartSpan, bytearray]] = field(default_factory=dict)


def layout_parts(layout: FileLayout, runs: Sequence[Sequence[int]], part_bytes: int = PART_BYTES) -> PartPlan:
    """The parts of ``layout`` written by processes whose tensors are ``runs`` (``core/parts.plan_parts``)."""
    return plan_parts(layout.offsets, [t.nbytes for t in layout.tensors], layout.size, runs, part_bytes=part_bytes)


def open_upload(output: str, *, inputs: Iterable[Any], overwrite: bool) -> tuple[Multipart, str] | None:
    """``output``'s multipart upload, begun: ``(upload, its id)``; ``None`` where its backend has none. Refused first:
    ``output`` naming an input, an object already there unless ``overwrite``."""
    url = str(output).rstrip("/")
    if any(str(i).rstrip("/") == url for i in inputs if i is not None):
        raise ValueError(f"output: {url} is also an input; write to another place")
    parent, name = url.rsplit("/", 1)
    store = where(parent)
    upload = store.multipart(name)
    if upload is None:
        return None
    if not overwrite and store.size(name) is not None:
        raise FileExistsError(f"output: {url}: an object is there already; pass --overwrite to replace it")
    return upload, upload.begin()


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
    room, held for :func:`commit_parts`). ``after(nbytes)`` runs after each tensor."""
    share = Share()
    spans = plan.parts[rank]
    room = layout.offsets[0] if layout.offsets else layout.size  # the header's
    parts = _Parts(spans, lambda s, data: upload.put_part(upload_id, s.number, data), room, share)
    if spans and spans[0].start == 0:
        parts.feed(memoryview(bytes(room)))  # zeros: the header is written there at the commit
    for i in plan.runs[rank]:
        t = layout.tensors[i]
        tensor = t.make()
        if tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
            raise ValueError(
                f"tensor '{t.name}': made as {tensor.dtype} {list(tensor.shape)}, planned as {t.dtype} {list(t.shape)}"
            )
        share.sums[t.name] = tensor_checksums(tensor, t.nbytes)
        parts.feed(_bytes_of(tensor))
        del tensor
        after(t.nbytes)
    parts.close()
    return share


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data).cast("B")


def commit_parts(layout: FileLayout, upload: Multipart, upload_id: str, held: Share, shares: Sequence[Share]) -> None:
    """The header (every share's checksums) written into ``held``'s parts, which are put; the upload completed."""
    header = final_header(layout, [share.sums for share in shares])
    for span, buffer in held.held.values():
        piece = header[span.start : span.stop]
        buffer[: len(piece)] = piece
    parts = [upload.put_part(upload_id, span.number, buffer) for span, buffer in held.held.values()]
    upload.complete(upload_id, [*parts, *(p for s in shares for p in s.parts)])


def abort_quietly(upload: Multipart, upload_id: str) -> None:
    """The upload aborted, a failure to abort ignored (the failure that brought the caller here is the one told)."""
    try:
        upload.abort(upload_id)
    except Exception:  # noqa: S110 - the failure that brought us here is the one to report; the upload never completes
        pass


class UploadSink:
    """The parts of one multipart upload (:class:`~fsdp_optim.offline.onefile.Sink`): each process puts the parts of
    its run; process 0 holds the part with the header's room, writes the header into it and completes the upload."""

    def __init__(self, layout: FileLayout, plan: PartPlan, upload: Multipart, upload_id: str) -> None:  # noqa: D107
        self.layout, self.plan, self.upload, self.upload_id = layout, plan, upload, upload_id

    def write(self, which: Sequence[int], rank: int, after: Callable[[int], None]) -> Share:
        if list(which) != list(self.plan.runs[rank]):
            raise RuntimeError(f"consolidate: process {rank}'s parts were planned for another run of tensors")
        return write_parts(self.layout, self.plan, rank, self.upload, self.upload_id, after=after)

    def sent(self, share: Share) -> Share:
        return Share(share.sums, share.parts)  # the held part stays on process 0

    def commit(self, mine: Share, shares: Sequence[Share]) -> None:
        commit_parts(self.layout, self.upload, self.upload_id, mine, shares)


def to_upload(
    team: Team | None, layout: FileLayout, runs: Sequence[Sequence[int]], output: str,
    fill: Callable[[UploadSink], tuple[Share, list[Share]]], *, inputs: Sequence[Any], overwrite: bool, part_bytes: int,
) -> int | None:  # fmt: skip
    """The multipart sink of :func:`~fsdp_optim.offline.onefile.write_one_file`: process 0 refuses an object there
    (unless ``overwrite``) and begins the upload, and every process gets its id; ``fill`` puts every process's parts;
    process 0 completes the upload; every process agrees on that commit. Process 0 aborts the upload after any
    failure it sees. Returns the object's size (0 on a process but 0), ``None`` where a process alone finds that the
    store takes no multipart uploads."""
    plan = layout_parts(layout, runs, part_bytes)
    begun = None
    with stepped(team, "consolidate: process 0 could not begin the upload; nothing was written"):
        if team is None or team.rank == 0:
            begun = open_upload(output, inputs=inputs, overwrite=overwrite)
            if begun is None and team is not None:
                raise ValueError(f"output: {output}: its store takes no multipart uploads")
    if team is not None:
        begun = _joined(team, output, begun)
    if begun is None:
        return None
    upload, upload_id = begun
    sink = UploadSink(layout, plan, upload, upload_id)
    try:
        mine, shares = fill(sink)
        with stepped(team, "consolidate: the commit failed on process 0"):
            if team is None or team.rank == 0:
                sink.commit(mine, shares)
    except BaseException:
        if team is None or team.rank == 0:
            abort_quietly(upload, upload_id)
        raise
    return layout.size if team is None or team.rank == 0 else 0


def _joined(team: Team, output: str, begun: tuple[Multipart, str] | None) -> tuple[Multipart, str]:
    """The upload process 0 began, on every process with its own client."""
    upload_id = team.from_first(None if begun is None else begun[1])
    if begun is not None:
        return begun
    parent, name = output.rstrip("/").rsplit("/", 1)
    upload = where(parent).multipart(name)
    if upload is None:
        raise ValueError(f"output: {output}: its store takes no multipart uploads here, though it did on process 0")
    return upload, str(upload_id)
