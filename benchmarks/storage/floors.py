"""Floors: the least work that moves a checkpoint's bytes to and from the store with s3fs alone.

- ``upload``: one ``pipe_file`` of bytes already in memory: s3fs's multipart upload (50 MiB parts, its default
  ``max_concurrency`` of 10 in flight), the same client, part size and concurrency as the library's ``put_file``
  of its rank file; nothing is serialized, staged or checksummed;
- ``download``: the object fetched in 16 MiB ranged pieces, 8 in flight, into one buffer (the library's own read
  pattern, ``fsdp_optim.disk.storage``, with the same fallback: a piece that failed is fetched again on its own),
  nothing parsed or checked;
- ``blob``: a rank's weight shards and optimizer state tensors as one ``bytes`` (made once, untimed): the floors
  move the bytes a rank's state holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PIECE_BYTES = 16 << 20
IN_FLIGHT = 8


def blob(model: nn.Module, optim: torch.optim.Optimizer) -> bytes:
    tensors = [p.data for p in model.parameters()]
    tensors += [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return b"".join(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def upload(fs: Any, key: str, data: bytes) -> None:
    fs.pipe_file(key, data)


def _piece(fs: Any, key: str, start: int, stop: int, attempts: int = 3) -> bytes:
    for attempt in range(attempts):
        try:
            data = fs.cat_file(key, start=start, end=stop)
            if len(data) == stop - start:
                return data
        except Exception:
            if attempt == attempts - 1:
                raise
    raise OSError(f"{key}: short reads of bytes {start}..{stop}")


def download(fs: Any, key: str, size: int) -> bytearray:
    out = bytearray(size)
    bounds = [(a, min(a + PIECE_BYTES, size)) for a in range(0, size, PIECE_BYTES)]
    for first in range(0, len(bounds), IN_FLIGHT):
        batch = bounds[first : first + IN_FLIGHT]
        got = fs.cat_ranges([key] * len(batch), [a for a, _ in batch], [b for _, b in batch], on_error="return")
        for (a, b), data in zip(batch, got):
            if not isinstance(data, (bytes, bytearray)) or len(data) != b - a:  # a timeout or reset under load
                data = _piece(fs, key, a, b)
            out[a:b] = data
    return out
