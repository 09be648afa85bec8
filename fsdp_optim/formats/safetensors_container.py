"""The safetensors container, once for every format that uses it: its dtype names, its header written, and its
header read back without trusting it.

Rank files (:mod:`.sharded.rank_file`), named optimizer files (:mod:`.named_safetensors`) and Hugging
Face model files (:mod:`.hf_safetensors`) are all this container::

    <u64 n> {"__metadata__": {str: str, ...},
             "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}   <data>

:func:`read_header` refuses, as a :class:`HeaderError` naming the file, expected and found, whatever safetensors
itself refuses (a header past its bound, not a JSON object, metadata not strings, unknown dtypes, offsets that
disagree with shapes, overlap or do not tile the data) and more than :data:`MAX_RECORDS` tensors. What a format asks
beyond that its own module checks on the :class:`ContainerHeader` returned.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.limits import MAX_RECORDS
from fsdp_optim.disk.json_input import RefusedJSON, loads
from fsdp_optim.disk.text import escape
from fsdp_optim.disk.untrusted import open_regular

__all__ = [
    "DTYPES", "DTYPE_NAMES", "MAX_HEADER_BYTES", "PORTABLE_DTYPES", "ContainerHeader", "HeaderError", "HeaderRules",
    "Tensor", "TensorSpan", "check_portable", "data_bytes", "encode_header", "read_file_header", "read_header",
]  # fmt: skip

MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on the JSON header

# safetensors' dtype names. The float8 "fnuz" kinds are ours to read and write in rank files; a file meant for
# other readers (named optimizer files, model files) uses only PORTABLE_DTYPES, the names every reader knows.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}  # fmt: skip
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
PORTABLE_DTYPES = {dtype: name for dtype, name in DTYPE_NAMES.items() if not name.endswith("FNUZ")}


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: name, shape, dtype and ``make()`` (a new CPU tensor, called when its bytes are due)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def made(self) -> torch.Tensor:
        """``make()``, refused (``ValueError``) unless of the promised dtype and shape."""
        tensor = self.make()
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"tensor '{self.name}': made as {tensor.dtype} {list(tensor.shape)}, planned as "
                             f"{self.dtype} {list(self.shape)}")  # fmt: skip
        return tensor


def check_portable(name: str, dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if every safetensors reader names it (:data:`PORTABLE_DTYPES`), else ``ValueError`` naming ``name``."""
    if dtype not in PORTABLE_DTYPES:
        raise ValueError(f"tensor '{name}' has dtype {dtype}, which safetensors cannot name; expected one of "
                         f"{sorted(map(str, PORTABLE_DTYPES))}")  # fmt: skip
    return dtype


def data_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as the file holds them (C order, flat)."""
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data).cast("B")


class HeaderError(ValueError):
    """A safetensors header we refuse; the message names the file, what was expected and what was found."""


@dataclass(frozen=True)
class HeaderRules:
    """What a format asks of the container beyond safetensors' own rules: the longest header in a file of ``size``
    bytes, ``min(size - 8, fixed + size // per)`` (``per`` 0: no share of the file), never over
    :data:`MAX_HEADER_BYTES` (``rule`` says it in words); ``entry(at, name, dtype name, shape)`` called per tensor
    before its offsets are read, raising :class:`HeaderError` for what the format refuses."""

    fixed: int = MAX_HEADER_BYTES
    per: int = 0
    rule: str = "safetensors' own 100 MB"
    entry: Callable[[str, str, str, list[int]], None] | None = None

    def limit(self, size: int) -> int:
        share = size // self.per if self.per else 0
        return min(size - 8, self.fixed + share, MAX_HEADER_BYTES)


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of the file: its dtype, shape, first byte in the file and byte count (checked against both)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ContainerHeader:
    """A checked header: its metadata, its tensors in header order, and the header's JSON bytes."""

    metadata: Mapping[str, str]
    tensors: Mapping[str, TensorSpan]
    text: bytes


def encode_header(
    metadata: Mapping[str, str],
    tensors: Iterable[tuple[str, torch.dtype, Iterable[int]]],
    names: Mapping[torch.dtype, str] = DTYPE_NAMES,
) -> bytes:
    """The header of a file of ``tensors`` (``(name, dtype, shape)``, in file order, packed one after another),
    length prefix included, padded with spaces so that the data starts 8-byte aligned (as safetensors pads).
    ``names``: safetensors' name of each dtype the file may hold."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    at = 0
    for name, dtype, shape in tensors:
        shape = list(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(fd: int | Callable[[int, int], bytes], size: int, where: str, rules: HeaderRules) -> ContainerHeader:
    """The checked header of the safetensors file open as ``fd`` (``size`` bytes long); ``fd`` may instead be a
    function ``pread(count, offset) -> bytes`` (an object in a store, read by ranges)."""
    pread = (lambda count, offset: os.pread(fd, count, offset)) if isinstance(fd, int) else fd
    if size < 8:
        raise HeaderError(
            f"{where}: {size} bytes, too short for a safetensors file (expected an 8-byte header length first)"
        )
    (n,) = struct.unpack("<Q", pread(8, 0))
    limit = rules.limit(size)
    if n > limit:
        past = f"; header length {n} is past the file" if n > size - 8 else ""
        raise HeaderError(
            f"{where}: declares a {n}-byte header, expected at most {limit} (the file has {size} bytes; a header is "
            f"bounded by {rules.rule}){past}"
        )
    text = pread(n, 8)
    header = _parse(text, where)
    metadata = header.pop("__metadata__", {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"{where}: '__metadata__' values must be strings (the safetensors format)")
    if len(header) > MAX_RECORDS:
        raise HeaderError(f"{where}: {len(header)} tensors, over the bound {MAX_RECORDS}")
    data = size - 8 - n
    spans = {name: _span(name, e, data, 8 + n, where, rules) for name, e in header.items()}
    _check_tiling(spans, 8 + n, data, where)
    return ContainerHeader(metadata, spans, text)


def read_file_header(path: str | os.PathLike[str], rules: HeaderRules = HeaderRules()) -> ContainerHeader:
    """The checked header of the file at ``path``, opened through the gate for untrusted files."""
    fd, st = open_regular(path)
    try:
        return read_header(fd, st.st_size, str(path), rules)
    finally:
        os.close(fd)


def _parse(text: bytes, where: str) -> dict[str, Any]:
    try:
        header = loads(text, where=f"{where}: the safetensors header", parse_constant=_refuse_constant)
    except RefusedJSON as exc:
        raise HeaderError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise HeaderError(f"{where}: the safetensors header is not JSON ({escape(str(exc), limit=200)})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise HeaderError(
            f"{where}: the safetensors header must be an object with an object '__metadata__', found "
            f"{type(header).__name__}"
        )
    return header


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _span(name: str, e: Any, data: int, data_start: int, where: str, rules: HeaderRules) -> TensorSpan:
    """One tensor entry checked alone."""
    at = f"{where}: tensor '{escape(str(name), limit=80)}'"
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        found = escape(repr(sorted(e)), limit=120) if isinstance(e, dict) else type(e).__name__
        raise HeaderError(f"{at}: expected an object with 'dtype', 'shape', 'data_offsets', found {found}")
    dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None:
        raise HeaderError(f"{at}: dtype {escape(repr(e['dtype']), limit=40)}, expected one of {sorted(DTYPES)}")
    shape, offsets = e["shape"], e["data_offsets"]
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise HeaderError(f"{at}: shape {escape(repr(shape), limit=80)}, expected a list of non-negative ints")
    if rules.entry is not None:
        rules.entry(at, name, e["dtype"], shape)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise HeaderError(f"{at}: data_offsets {escape(repr(offsets), limit=80)}, expected [begin, end] (two ints)")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end <= data:
        raise HeaderError(f"{at}: data_offsets [{begin}, {end}] lie outside the file's {data} bytes of data")
    if end - begin != nbytes:
        raise HeaderError(
            f"{at}: shape {shape} of {e['dtype']} is {nbytes} bytes but its offsets [{begin}, {end}] span "
            f"{end - begin} (expected {nbytes} for shape {shape})"
        )
    return TensorSpan(dtype, tuple(shape), data_start + begin, nbytes)


def _check_tiling(spans: Mapping[str, TensorSpan], data_start: int, data: int, where: str) -> None:
    """The tensors must tile the data exactly (what safetensors itself requires): no overlap, no gap."""
    at = 0
    placed = sorted((s.start - data_start, s.start - data_start + s.nbytes, n) for n, s in spans.items())
    for begin, end, name in placed:
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves bytes {at}..{begin} unused"
            raise HeaderError(f"{where}: tensor '{escape(name, limit=80)}' at data_offsets [{begin}, {end}] {what}")
        at = end
    if at != data:
        raise HeaderError(f"{where}: the tensors cover {at} bytes of data, but the file holds {data} after its header")
