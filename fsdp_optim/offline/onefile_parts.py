"""``consolidate -o s3://bucket/x/model.safetensors``: the one safetensors file of :mod:`fsdp_optim.offline.onefile`
written straight into an object store as the parts of ONE multipart upload (:mod:`fsdp_optim.disk.multipart`),
never whole on a local disk. The same layout, so the same bytes as the local file::

    plan     lay_out (onefile.py); the parts: core/parts.plan_parts (process 0's first part holds the header's room)
    begin    the object refused if present (unless overwrite), one upload begun
    write    each tensor made, hashed, its bytes fed into the current part's buffer; a full part is put (the part
             that holds the header's room is held instead), then the next
    commit   the header with every checksum written into the held part, which is put; the upload completed with
             every part: the object appears whole, at once

A failure at any step aborts the upload: no object appears. Memory: one tensor and one part buffer (64 MiB), and
the held first part. Under ``torchrun`` each process writes its own parts (:mod:`fsdp_optim.offline.parallel.upload`).
A store without multipart uploads gets the file written locally and uploaded whole (``offline/publish.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_optim.core.parts import PART_BYTES, PartPlan, PartSpan, plan_parts
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.multipart import Multipart, Part
from fsdp_optim.formats.named_safetensors.writer import tensor_checksums
from fsdp_optim.offline.onefile import FileLayout, described, final_header, lay_out, write_one_process

__all__ = [
    "Share",
    "abort_quietly",
    "commit_parts",
    "consolidate_to_store",
    "layout_parts",
    "open_upload",
    "write_parts",
]


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


def consolidate_to_store(
    opened: Any, output: str, *, rank: int | None, no_model: bool, inputs: Sequence[Any], overwrite: bool,
    progress: Callable[[], None] | None, part_bytes: int = PART_BYTES,
) -> str:  # fmt: skip
    """:func:`~fsdp_optim.offline.onefile.consolidate_to_safetensors` into the object ``output`` (a URL) by this
    process: one multipart upload (module docstring), or, where the store has none, the file written locally and
    uploaded whole. Returns the report."""
    layout = lay_out(opened, rank=rank, no_model=no_model)
    begun = open_upload(output, inputs=inputs, overwrite=overwrite)
    if begun is None:
        return _written_then_uploaded(opened, layout, output, overwrite=overwrite, inputs=inputs, progress=progress)
    upload, upload_id = begun
    try:
        plan = layout_parts(layout, [range(len(layout.tensors))], part_bytes)

        def after(nbytes: int) -> None:  # noqa: ARG001
            opened.trim()
            if progress is not None:
                progress()

        share = write_parts(layout, plan, 0, upload, upload_id, after=after)
        commit_parts(layout, upload, upload_id, share, [share])
    except BaseException:
        abort_quietly(upload, upload_id)
        raise
    return described(layout, layout.size)


def abort_quietly(upload: Multipart, upload_id: str) -> None:
    """The upload aborted, a failure to abort ignored (the failure that brought the caller here is the one told)."""
    try:
        upload.abort(upload_id)
    except Exception:  # noqa: S110 - the failure that brought us here is the one to report; the upload never completes
        pass


def _written_then_uploaded(opened: Any, layout: FileLayout, output: str, *, overwrite: bool, inputs: Sequence[Any],
                           progress: Callable[[], None] | None) -> str:  # fmt: skip
    from fsdp_optim.disk.staged import write_stream
    from fsdp_optim.offline.publish import output_for

    with output_for(output, overwrite=overwrite, inputs=inputs, keep_checkpoint=True) as local:
        size = write_stream(write_one_process(layout, opened.trim, progress), local, purpose="fsdp_optim.consolidate")
    return described(layout, size)
