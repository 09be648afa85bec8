"""The safetensors container of our rank files: its header written, and read back without trusting it.

Pure apart from reading the header's bytes through a file descriptor. The layout (safetensors')::

    <u64 n> {"__metadata__": {str: str, ...},
             "float32": {"dtype": "F32", "shape": [184], "data_offsets": [0, 736]}, ...}   <data>

:func:`read_header` bounds the header's length by the file and by :func:`header_bound` before reading it, and
refuses unknown dtypes, shapes that are not one non-negative int, offsets out of the data, overlapping or not
tiling it, and byte counts that disagree with the shapes, each as a ``ValueError`` naming the file, what was
expected and what was found.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_optim.core.checksums import digest
from fsdp_optim.core.dtypes import dtype_from_str
from fsdp_optim.disk.json_input import RefusedJSON, loads
from fsdp_optim.disk.text import escape

__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "Header", "encode_header", "header_bound", "read_header"]

# A rank file's header holds one entry per dtype and, in format 3, its chunk checksums (~48 bytes per 64 KiB
# chunk: 0.07 % of the data); bounded by 1 MiB + 1/256 of the file, and by safetensors' own 100 MB.
MAX_HEADER_BYTES = 100_000_000
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "uint64": "U64", "uint32": "U32", "uint16": "U16",
}  # fmt: skip
_TORCH_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class Header:
    """A checked rank-file header: its metadata, ``{name: (dtype name, numel, byte offset in the file)}``, its
    digest."""

    metadata: Mapping[str, str]
    tensors: Mapping[str, tuple[str, int, int]]
    checksum: str


def header_bound(size: int) -> int:
    """The longest header we accept in a file of ``size`` bytes."""
    return min(size - 8, (1 << 20) + size // 256, MAX_HEADER_BYTES)


def encode_header(metadata: Mapping[str, str], sizes: Mapping[str, int]) -> bytes:
    """The header of a file of one 1-D tensor per dtype (``sizes``: ``{dtype name: numel}``, in file order),
    length prefix included, padded so that the data starts 8-byte aligned (as safetensors writes it)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    at = 0
    for name, numel in sizes.items():
        nbytes = numel * dtype_from_str(name, where="state").itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[name], "shape": [numel], "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(fd: int, size: int, where: str) -> Header:
    """The checked header of the safetensors file open as ``fd`` (``size`` bytes long)."""
    if size < 8:
        raise ValueError(
            f"{where}: {size} bytes, too short for a safetensors file (expected an 8-byte header length "
            "first)"
        )
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > header_bound(size):
        raise ValueError(
            f"{where}: declares a {n}-byte header, expected at most {header_bound(size)} (the file has {size} bytes; "
            "a header is bounded by 1 MiB + 1/256 of the file)"
        )
    text = os.pread(fd, n, 8)
    try:
        header = loads(text, where=f"{where}: the safetensors header", parse_constant=_refuse_constant)
    except RefusedJSON:
        raise
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: the safetensors header is not JSON ({escape(str(exc), limit=200)})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ValueError(
            f"{where}: the safetensors header must be an object with an object '__metadata__', found "
            f"{type(header).__name__}"
        )
    metadata = header.pop("__metadata__", {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{where}: '__metadata__' values must be strings (the safetensors format)")
    data = size - 8 - n
    tensors = {name: _entry(name, e, data, where) for name, e in header.items()}
    _check_disjoint(header, data, where)
    offsets = {name: (dt, numel, 8 + n + start) for name, (dt, numel, start) in tensors.items()}
    return Header(metadata, offsets, digest(text))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _entry(name: str, e: Any, data: int, where: str) -> tuple[str, int, int]:
    """One tensor entry checked alone: ``(dtype name, numel, start byte in the data)``."""
    at = f"{where}: tensor '{escape(str(name), limit=80)}'"
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        found = escape(repr(sorted(e)), limit=120) if isinstance(e, dict) else type(e).__name__
        raise ValueError(f"{at}: expected an object with 'dtype', 'shape', 'data_offsets', found {found}")
    dtype = _TORCH_NAMES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None or dtype != name:
        raise ValueError(
            f"{at}: dtype {escape(repr(e['dtype']), limit=40)}, expected "
            f"{SAFETENSORS_DTYPES.get(name, 'the dtype it is named by')!r}"
        )
    shape, offsets = e["shape"], e["data_offsets"]
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
        raise ValueError(f"{at}: shape {escape(repr(shape), limit=80)}, expected [n] (one non-negative int)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise ValueError(f"{at}: data_offsets {escape(repr(offsets), limit=80)}, expected [begin, end] (two ints)")
    begin, end = offsets
    nbytes = shape[0] * dtype_from_str(dtype, where=at).itemsize
    if not 0 <= begin <= end <= data:
        raise ValueError(f"{at}: data_offsets [{begin}, {end}] lie outside the file's {data} bytes of data")
    if end - begin != nbytes:
        raise ValueError(
            f"{at}: data_offsets [{begin}, {end}] span {end - begin} bytes, expected {nbytes} for shape "
            f"{shape} {dtype}"
        )
    return dtype, shape[0], begin


def _check_disjoint(header: Mapping[str, Any], data: int, where: str) -> None:
    """The tensors must tile the data exactly (what safetensors itself requires): no overlap, no gap."""
    at = 0
    for begin, end, name in sorted((e["data_offsets"][0], e["data_offsets"][1], n) for n, e in header.items()):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves bytes {at}..{begin} unused"
            raise ValueError(f"{where}: tensor '{escape(name, limit=80)}' at data_offsets [{begin}, {end}] {what}")
        at = end
    if at != data:
        raise ValueError(f"{where}: the tensors cover {at} bytes of data, but the file holds {data} after its header")
