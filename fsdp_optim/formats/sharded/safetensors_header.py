"""The safetensors container of our rank files: one 1-D tensor per dtype, named by it, and its header.

The container itself (its dtype names, bounds and tiling) is :mod:`fsdp_optim.formats.safetensors_container`;
this module adds what a rank file asks of it::

    <u64 n> {"__metadata__": {str: str, ...},
             "float32": {"dtype": "F32", "shape": [184], "data_offsets": [0, 736]}, ...}   <data>

:func:`read_rank_header` bounds the header by 1 MiB + 1/256 of the file (:data:`RANK_HEADER_RULES`), reads it
through the container's reader, and refuses a tensor not named by its dtype or not one-dimensional, each as a
``ValueError`` naming the file, what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fsdp_optim.core.checksums import digest
from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.disk.text import escape
from fsdp_optim.formats.safetensors_container import (
    DTYPE_NAMES,
    HeaderError,
    HeaderRules,
    encode_header,
    read_header,
)

__all__ = ["RANK_HEADER_RULES", "Header", "encode_rank_header", "read_rank_header"]


def _rank_entry(at: str, name: str, dtype: str, shape: list[int]) -> None:
    """A rank file's tensor is named by its dtype and one-dimensional."""
    wanted = next((st for dt, st in DTYPE_NAMES.items() if dtype_to_str(dt) == name), None)
    if dtype != wanted:
        expected = repr(wanted) if wanted else "the dtype it is named by"
        raise HeaderError(f"{at}: dtype {escape(repr(dtype), limit=40)}, expected {expected}")
    if len(shape) != 1:
        raise HeaderError(f"{at}: shape {escape(repr(shape), limit=80)}, expected [n] (one non-negative int)")


# A rank file's header holds one entry per dtype and, in format 3, its chunk checksums (~48 bytes per 64 KiB
# chunk: 0.07 % of the data); bounded by 1 MiB + 1/256 of the file, and by safetensors' own 100 MB.
RANK_HEADER_RULES = HeaderRules(1 << 20, 256, "1 MiB + 1/256 of the file", _rank_entry)


@dataclass(frozen=True)
class Header:
    """A checked rank-file header: its metadata, ``{name: (dtype name, numel, byte offset in the file)}``, its
    digest."""

    metadata: Mapping[str, str]
    tensors: Mapping[str, tuple[str, int, int]]
    checksum: str


def encode_rank_header(metadata: Mapping[str, str], sizes: Mapping[str, int]) -> bytes:
    """The header of a file of one 1-D tensor per dtype (``sizes``: ``{dtype name: numel}``, in file order),
    length prefix included, padded so that the data starts 8-byte aligned (as safetensors writes it)."""
    return encode_header(metadata, ((name, dtype_from_str(name, where="state"), (n,)) for name, n in sizes.items()))


def read_rank_header(fd: int | Callable[[int, int], bytes], size: int, where: str) -> Header:
    """The checked header of the rank file open as ``fd`` (``size`` bytes long; or read by ``pread(count, offset)``)."""
    try:
        header = read_header(fd, size, where, RANK_HEADER_RULES)
    except HeaderError as exc:
        raise ValueError(str(exc)) from None  # what a rank file's readers refuse with
    tensors = {name: (name, span.shape[0], span.start) for name, span in header.tensors.items()}
    return Header(header.metadata, tensors, digest(header.text))
