"""Content digests of nested values (tensors read without copying): what every checkpoint records and every
reader checks."""

from __future__ import annotations

import codecs
import ctypes
import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
import xxhash

from fsdp_optim.core.dtypes import dtype_to_str

# Checksums guard against corruption, not forgery (a forger rewrites the stored digest too), so new
# files use xxh3-128 (xxhash: ~12 GB/s on one core here, against ~1.7 GB/s for SHA-256); files written
# with SHA-256 by earlier versions still verify. The prefix of a digest names its algorithm.
DIGEST_ALGORITHM = "xxh3-128"


class _Hash(Protocol):
    """A running hash (xxhash's or hashlib's)."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_HASHES: dict[str, Callable[[], _Hash]] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def digest(value: object, algorithm: str = DIGEST_ALGORITHM) -> str:
    """A content digest of a (nested) value: ``"xxh3-128:<hex>"``. Reads tensor bytes without copying them."""
    h = _HASHES[algorithm]()
    _feed(h, value)
    return f"{algorithm}:{h.hexdigest()}"


def digests_of_chunks(values: torch.Tensor, per: int) -> tuple[str, ...]:
    """``digest(values[k : k + per])`` for every ``k`` in ``range(0, numel, per)`` of a 1-D tensor: the same
    digests, without building a slice and walking it per chunk (a 100M-parameter state has ~12,000 chunks)."""
    assert values.dim() == 1 and per > 0, f"expected a 1-D tensor and chunks > 0, found {tuple(values.shape)}, {per}"
    return stream_chunk_digests((values,), per, values.numel())


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())) if nbytes else memoryview(b"")


class ChunkHasher:
    """:func:`digests_of_chunks` of one dtype's elements, fed as raw bytes in order, split anywhere (a piece may end
    inside an element or a chunk): what a writer computes while the bytes pass through it on their way to the file.

    ``per`` elements per chunk, ``total`` elements in all, each ``element_size`` bytes, digests named by ``dtype``.
    """

    def __init__(self, dtype: str, element_size: int, per: int, total: int) -> None:
        assert per > 0 and total >= 0 and element_size > 0, f"expected chunks > 0, found {per}, {total}, {element_size}"
        self._dtype, self._size, self._per, self._total = dtype, element_size, per, total
        self._digests: list[str] = []
        self._h: _Hash | None = None
        self._left = 0  # bytes the open chunk still takes
        self._fed = 0

    def update(self, raw: memoryview) -> None:
        """Feed the next ``len(raw)`` bytes."""
        at, n = 0, len(raw)
        assert self._fed + n <= self._total * self._size, (
            f"fed {self._fed + n} bytes, expected {self._total * self._size}"
        )
        while at < n:
            if self._h is None:
                count = min(self._per, self._total - len(self._digests) * self._per)
                self._h = xxhash.xxh3_128(f"T{self._dtype}({count},)|".encode())
                self._left = count * self._size
            take = min(self._left, n - at)
            self._h.update(raw[at : at + take])
            at, self._left = at + take, self._left - take
            if self._left == 0:
                self._digests.append(f"{DIGEST_ALGORITHM}:{self._h.hexdigest()}")
                self._h = None
        self._fed += n

    def digests(self) -> tuple[str, ...]:
        """Every chunk's digest, once all ``total`` elements were fed."""
        assert self._fed == self._total * self._size and self._h is None, (
            f"fed {self._fed} bytes, expected {self._total * self._size}"
        )
        return tuple(self._digests)


def stream_chunk_digests(parts: Iterable[torch.Tensor], per: int, total: int) -> tuple[str, ...]:
    """:func:`digests_of_chunks` of the concatenation of the 1-D ``parts`` (``total`` elements of one dtype in all),
    without concatenating them: a chunk may span several parts, a part several chunks."""
    assert per > 0 and total >= 0, f"expected chunks > 0 and a total >= 0, found {per}, {total}"
    hasher: ChunkHasher | None = None
    for part in parts:
        t = part.detach().cpu().contiguous()
        if hasher is None:
            hasher = ChunkHasher(dtype_to_str(t.dtype), t.element_size(), per, total)
        hasher.update(_raw(t))
    assert hasher is not None or total == 0, f"no parts, expected {total} elements"
    return hasher.digests() if hasher is not None else ()


def digest_matches(value: object, expected: object) -> bool:
    """Whether ``expected`` (a stored digest, any supported algorithm) is the digest of ``value``."""
    algorithm = expected.partition(":")[0] if isinstance(expected, str) else None
    return algorithm in _HASHES and digest(value, algorithm) == expected


_TEXT_CHUNK = 1 << 20


def text_digest_matches(data: bytes, expected: object, start: int, end: int) -> bool:
    """``digest_matches(data[start:end].decode("utf-8", "replace"), expected)``, the text decoded and escaped
    (``repr``) a chunk at a time: memory stays the chunk's, not 5-11x the text's (a manifest's checksum)."""
    algorithm = expected.partition(":")[0] if isinstance(expected, str) else None
    if algorithm not in _HASHES:
        return False
    h = _HASHES[algorithm]()
    # repr() quotes with ' unless the text holds ' and no ": the one choice that depends on the whole text
    # (a ' or " byte is never part of a longer UTF-8 sequence, and 'replace' makes no quotes).
    double = data.find(b"'", start, end) >= 0 and data.find(b'"', start, end) < 0
    quote = '"' if double else "'"
    h.update(f"str:{quote}".encode())
    decoder, view = codecs.getincrementaldecoder("utf-8")("replace"), memoryview(data)
    for k in range(start, max(start, end), _TEXT_CHUNK):
        h.update(_escaped(decoder.decode(view[k : min(k + _TEXT_CHUNK, end)]), double).encode())
    h.update(_escaped(decoder.decode(b"", final=True), double).encode())
    h.update(f"{quote}|".encode())
    return f"{algorithm}:{h.hexdigest()}" == expected


def _escaped(text: str, double: bool) -> str:
    """``repr(text)`` without its quotes, as ``repr`` of the whole text escapes it (its quote is " if ``double``)."""
    return repr(text)[1:-1] if double else repr(text + '"')[1:-2]


_PLAIN = frozenset({int, float, str, bool, type(None)})  # leaves fed as "type:repr|"


def _feed(h: _Hash, value: object) -> None:
    if torch.is_tensor(value):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h.update(f"T{dtype_to_str(t.dtype)}{tuple(t.shape)}|".encode())
        h.update(_raw(t))
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)}|".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _feed(h, key)
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}{len(value)}|".encode())
        if all(type(item) in _PLAIN for item in value):
            # The same bytes as one _feed per item, in one update: a manifest's per-rank lists stay cheap.
            h.update("".join(f"{type(item).__name__}:{item!r}|" for item in value).encode())
            return
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__}:{value!r}|".encode())
