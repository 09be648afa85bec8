"""The bytes a memory-tier restore moves: what each rank sends from its node's memory, and what it receives, as
readers its load uses in place of files (no file written, nothing read twice).

A receiving rank's pieces of a rank file become a :class:`~fsdp_optim.formats.sharded.received.ReceivedFile`
(checked like a file on disk: its header against the manifest, each 64 KiB chunk against the header's checksum
before it is used), a side file's bytes a thunk that :func:`~fsdp_optim.formats.sharded.side_file.read_side_file`
checks against the manifest's digest. Each piece is waited for when the load first touches it, so a load reads
what its node holds while the rest is still arriving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.memory_plan import Fetch
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.received import Held, Piece, ReceivedFile, held_readers
from fsdp_optim.formats.sharded.side_file import Received
from fsdp_optim.job.memory_save import file_bytes

__all__ = ["InFlight", "received_files", "sends_of"]


class InFlight:
    """Transfers posted (:func:`fsdp_optim.job.transport.post_exchange`'s handles: the receives', then the sends'),
    and the sent tensors, kept alive until :meth:`finish`."""

    def __init__(self, works: list[Any], kept: Sequence[Any]) -> None:
        self._works, self._kept = works, list(kept)

    def wait(self, i: int) -> None:
        """Wait for handle ``i`` (receive ``i``), once."""
        work, self._works[i] = self._works[i], None
        if work is not None:
            work.wait()

    def finish(self) -> None:
        """Wait for every transfer, then raise the first error (a peer gone): nothing is left in flight."""
        errors = []
        for i in range(len(self._works)):
            try:
                self.wait(i)
            except Exception as exc:
                errors.append(exc)
        self._kept = []
        if errors:
            raise errors[0]


def sends_of(fetches: Sequence[Fetch], rank: int, directory: Path) -> tuple[list[tuple[int, torch.Tensor]], str | None]:
    """``(dst, bytes)`` of the fetches ``rank`` sends, in plan order: views of its node's files (mapped once each,
    copy on write: never written back), not copies; and what went wrong, if anything. A file that cannot be read
    is sent as zeros (its receivers refuse them by checksum) so that no receiver waits for ever."""
    mapped: dict[str, torch.Tensor] = {}
    out, failure = [], None
    for f in fetches:
        if f.src != rank:
            continue
        if f.file not in mapped:
            try:
                mapped[f.file] = file_bytes(directory / f.file)
            except OSError as exc:
                mapped[f.file], failure = torch.empty(0, dtype=torch.uint8), failure or f"{exc}"
        data = mapped[f.file]
        if data.numel() < f.stop:
            failure = failure or f"{directory / f.file}: {data.numel()} bytes, expected at least {f.stop}"
            out.append((f.dst, torch.zeros(f.nbytes, dtype=torch.uint8)))
        else:
            out.append((f.dst, data[f.start : f.stop]))
    return out, failure


def received_files(
    ckpt: ShardedCheckpoint, mine: Sequence[Fetch], received: Sequence[torch.Tensor], wait: Callable[[int], None]
) -> tuple[dict[int, Callable[[], ReceivedFile]], Received]:
    """This rank's received pieces (``received[i]`` is ``mine[i]``'s bytes once ``wait(i)`` returned) as readers:
    ``{saved rank: opener of its ReceivedFile}`` for rank files, ``{name: bytes thunk}`` for side files."""
    pieces: dict[str, list[Held]] = {}
    for i, (fetch, data) in enumerate(zip(mine, received, strict=True)):
        pieces.setdefault(fetch.file, []).append(Piece(fetch.start, data, partial(wait, i)))
    directory = Path(str(ckpt.directory))  # the memory tier: a local directory
    return held_readers(ckpt.manifest.files, lambda name: directory / name, pieces)
