"""``manifest.json``: a :class:`Manifest` as an exact, checksummed JSON document (formats 2 and 3), and back.

Pure: bytes in, bytes out. The document, on one line::

    {"fsdp_optim_checkpoint":{"kind":"manifest","version":3,"checksum":"xxh3-128:..."},"body":<body>}

``<body>`` is ``to_json(Manifest.to_dict())`` as ``json.dumps(..., separators=(",", ":"))`` writes it (key order
kept: param groups list their hyperparameters as the optimizer does). Format 3's checksum is the digest of
those bytes, so a reader checks it before parsing anything and parses the body once
(:func:`json.loads` with a hook that restores tagged values as it goes): reading the manifest of a
256-unit, 256-rank checkpoint costs ~10 ms. A format-3 manifest must therefore be exactly as written
(reformatting it is a modification). Format 2's checksum covered the body's canonical text
(``sort_keys=True``), which :func:`manifest_from_json` recomputes from the parsed body for those files.

Exact values (:func:`to_json`, :func:`from_json`: the very same tree back, types included; also used by side files
and named safetensors files). Plain JSON covers ``None``, ``bool``, ``int``, ``str``, lists, dicts with ``str``
keys and finite ``float`` (``repr(float)`` reads back bit-exactly); everything else is an object with one reserved
key::

    (0.9, 0.999)            -> {"$tuple": [0.9, 0.999]}
    float("inf")            -> {"$float": "inf"}                  # also "-inf", "nan"
    -float("nan")           -> {"$float": "nan:fff8000000000000"} # a NaN of other bits: its 8 bytes
    complex(1, 2)           -> {"$complex": [1.0, 2.0]}
    tensor(3.)              -> {"$tensor": {"dtype": "float32", "shape": [], "hex": "00004040"}}  # raw little-endian
    {"$x": 1}               -> {"$dict": {"$x": 1}}               # a dict whose keys look reserved

Anything else is refused with a ``ValueError`` naming where it is and what it is. Tensors are stored up to
:data:`MAX_TENSOR_BYTES`: shard-sized state belongs in the rank files.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeAlias, cast

import torch

from fsdp_optim.core.checksums import digest, digest_matches, text_digest_matches
from fsdp_optim.core.dtypes import dtype_from_str, dtype_to_str
from fsdp_optim.disk.json_input import DuplicateKeyError, RefusedJSON, check_depth, duplicate, loads, unique_object
from fsdp_optim.disk.text import escape
from fsdp_optim.formats.sharded.file_record import CHECKPOINT_VERSION, HEADER_KEY
from fsdp_optim.formats.sharded.manifest import Manifest

__all__ = [
    "MAX_MANIFEST_BYTES", "MAX_TENSOR_BYTES", "JSONValue", "from_json", "has_reserved_key", "manifest_from_json",
    "manifest_to_json", "to_json",
]  # fmt: skip

# What json.dumps writes and json.loads reads back.
JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"

MAX_TENSOR_BYTES = 4096
_TAGS = ("$tuple", "$float", "$complex", "$tensor", "$dict")


_PLAIN = (type(None), bool, int, str)
_UNRESERVED: set[str] = set()  # keys seen that do not start with "$": a manifest repeats a few dozen names
_UNRESERVED_MAX = 4096


def has_reserved_key(d: Mapping[Any, Any]) -> bool:
    """Whether a dict has a ``str`` key starting with ``$`` (checked as a set difference, in C, for the keys
    seen before: a manifest's dicts repeat the same few names thousands of times)."""
    new = d.keys() - _UNRESERVED
    if not new:
        return False
    if any(isinstance(k, str) and k.startswith("$") for k in new):
        return True
    if len(_UNRESERVED) < _UNRESERVED_MAX and all(type(k) is str for k in new):
        _UNRESERVED.update(new)
    return False


def _non_str_keys(d: Mapping[Any, Any]) -> list[Any]:
    """The keys of ``d`` that are not ``str`` (the keys seen before are known to be)."""
    return [k for k in d.keys() - _UNRESERVED if not isinstance(k, str)]


class _At:
    """Where a value sits in the tree, kept as parts and joined only for an error message (cheap per node)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.parts: list[str | int] = []  # a dict key (str: "['k']") or a list index (int: "[3]")

    def __str__(self) -> str:
        return self.where + "".join(f"['{p}']" if isinstance(p, str) else f"[{p}]" for p in self.parts)


def to_json(value: object, where: str) -> JSONValue:
    """``value`` as JSON-safe values (see the module docstring); ``where`` names it in errors."""
    return _to(value, _At(where))


def _to(value: object, at: _At) -> JSONValue:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": _non_finite(value)}
    if isinstance(value, complex):
        return {"$complex": [_to(value.real, at), _to(value.imag, at)]}
    if isinstance(value, (tuple, list)):
        out = [v if isinstance(v, _PLAIN) else _item(v, i, at) for i, v in enumerate(value)]
        return {"$tuple": out} if isinstance(value, tuple) else out
    if isinstance(value, Mapping):
        if _non_str_keys(value):
            bad = _non_str_keys(value)[0]
            raise ValueError(
                f"{at}: a dict keyed by {type(bad).__name__} ({bad!r}); a JSON manifest holds str keys "
                "only"
            )
        out_dict = {k: v if isinstance(v, _PLAIN) else _item(v, k, at) for k, v in value.items()}
        return {"$dict": out_dict} if has_reserved_key(value) else out_dict
    if torch.is_tensor(value):
        return {"$tensor": _tensor_to_json(value, str(at))}
    raise ValueError(
        f"{at}: a {type(value).__name__}, which a JSON manifest cannot hold exactly; expected None, bool, int, "
        "float, complex, str, a small dense CPU tensor, or lists/tuples/dicts of them"
    )


_QUIET_NAN = struct.pack(">d", float("nan"))
_NAN_BITS = re.compile(r"nan:[0-9a-f]{16}")


def _non_finite(value: float) -> str:
    """``"inf"``, ``"-inf"``, ``"nan"``; a NaN of other bits (sign, payload) as ``"nan:<its 8 bytes, hex>"``."""
    bits = struct.pack(">d", value)
    if value == value or bits == _QUIET_NAN:
        return repr(value)
    return f"nan:{bits.hex()}"


def _item(value: object, part: str | int, at: _At, convert: Callable[[Any, _At], Any] = _to) -> Any:
    """``convert`` (:func:`_to` or :func:`_from`) of ``value``, found at ``part`` of ``at``."""
    at.parts.append(part)
    out = convert(value, at)
    at.parts.pop()
    return out


def _tensor_to_json(t: torch.Tensor, where: str) -> dict[str, Any]:
    t = t.detach().cpu()
    if t.layout is not torch.strided or t.is_quantized or t.is_complex() or t.is_meta:
        raise ValueError(f"{where}: a {t.layout} {t.dtype} tensor; a JSON manifest holds dense real tensors only")
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(
            f"{where}: a tensor of {nbytes} bytes; a JSON manifest holds tensors up to {MAX_TENSOR_BYTES} "
            "bytes"
        )
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.reshape(-1, t.element_size()).flip(1).reshape(-1)
    return {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "hex": bytes(raw.tolist()).hex()}


def from_json(value: object, where: str) -> object:
    """The value :func:`to_json` was given, from what ``json.loads`` read (checked: a crafted file is refused)."""
    return _from(value, _At(where))


def _from(value: object, at: _At) -> object:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [v if isinstance(v, _PLAIN) else _item(v, i, at, _from) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        raise ValueError(f"{at}: expected a JSON value, found {type(value).__name__}")
    tags = [k for k in value if k.startswith("$")] if has_reserved_key(value) else []
    if not tags:
        return {k: v if isinstance(v, _PLAIN) else _item(v, k, at, _from) for k, v in value.items()}
    if len(value) != 1 or tags[0] not in _TAGS:
        raise ValueError(
            f"{at}: expected one of the tags {list(_TAGS)} alone in an object, found keys "
            f"{sorted(value)[:5]}"
        )
    tag, body = tags[0], value[tags[0]]
    if tag == "$dict":
        if not isinstance(body, dict):
            raise ValueError(f"{at}: '$dict' holds a {type(body).__name__}, expected an object")
        return {k: _item(v, k, at, _from) for k, v in body.items()}
    if tag == "$tuple":
        if not isinstance(body, list):
            raise ValueError(f"{at}: '$tuple' holds a {type(body).__name__}, expected a list")
        return tuple(_item(v, i, at, _from) for i, v in enumerate(body))
    if tag == "$float":
        if body in ("inf", "-inf", "nan"):
            return float(body)
        if isinstance(body, str) and _NAN_BITS.fullmatch(body):
            return struct.unpack(">d", bytes.fromhex(body[4:]))[0]
        raise ValueError(f"{at}: '$float' is {body!r}, expected 'inf', '-inf', 'nan' or 'nan:<16 hex digits>'")
    if tag == "$complex":
        if not (isinstance(body, list) and len(body) == 2 and all(isinstance(v, (int, float, dict)) for v in body)):
            raise ValueError(f"{at}: '$complex' is {body!r}, expected [real, imag]")
        re, im = (cast(float, _from(v, at)) for v in body)  # numbers, or tagged floats (complex() refuses the rest)
        return complex(re, im)
    return _tensor_from_json(body, str(at))


def _tensor_from_json(body: object, where: str) -> torch.Tensor:
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "hex"}:
        found = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"{where}: '$tensor' must be an object with 'dtype', 'shape', 'hex', found {found}")
    dtype = dtype_from_str(body["dtype"], where=where)
    shape, text = body["shape"], body["hex"]
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(s) is int and 0 <= s for s in shape):
        raise ValueError(f"{where}: tensor shape {escape(repr(shape), limit=80)}, expected at most 8 non-negative ints")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise ValueError(
            f"{where}: tensor of shape {shape} declares {nbytes} bytes; a JSON manifest holds up to "
            f"{MAX_TENSOR_BYTES}"
        )
    if not isinstance(text, str) or len(text) != 2 * nbytes:
        found = f"{len(text) // 2} bytes" if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{where}: tensor {dtype_to_str(dtype)}{shape} needs {nbytes} bytes of 'hex', found {found}")
    try:
        raw = torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)
    except ValueError:
        raise ValueError(f"{where}: tensor 'hex' is not hexadecimal") from None
    if sys.byteorder != "little" and dtype.itemsize > 1:
        raw = raw.reshape(-1, dtype.itemsize).flip(1).reshape(-1)
    return raw.view(dtype).reshape(shape).clone()


# ---- the manifest document

JSON_VERSIONS = (2, CHECKPOINT_VERSION)  # format 1 wrote manifest.pt
MAX_MANIFEST_BYTES = 64 << 20  # a 1,024-rank, 1,000-unit manifest is 0.1-20 MiB (docs/threat-model.md, "Bounds")
_WRITTEN = re.compile(rb'\A\{"' + HEADER_KEY.encode() + rb'":(\{[^{}]*\}),"body":')


def manifest_to_json(manifest: Manifest) -> bytes:
    """The document of ``manifest`` (the current format); ``ValueError`` names a value JSON cannot hold exactly."""
    if manifest.version != CHECKPOINT_VERSION:
        raise ValueError(f"manifest: version {manifest.version}; a JSON manifest is format {CHECKPOINT_VERSION}")
    body = json.dumps(to_json(manifest.to_dict(), "manifest"), separators=(",", ":"), allow_nan=False)
    head = {"kind": "manifest", "version": CHECKPOINT_VERSION, "checksum": digest(body)}
    return f'{{"{HEADER_KEY}":{json.dumps(head, separators=(",", ":"))},"body":{body}}}\n'.encode()


def manifest_from_json(data: bytes, *, source: str) -> Manifest:
    """Parse and check a ``manifest.json`` read from ``source`` (named in every error)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{source}: {len(data)} bytes, above the bound for a manifest ({MAX_MANIFEST_BYTES})")
    written = _WRITTEN.match(data)
    if written is not None and data.endswith(b"}\n"):
        head = _json(written.group(1), source)
        if isinstance(head, dict) and head.get("version") == CHECKPOINT_VERSION:
            return _read_as_written(data, written.end(), head, source)
    doc = _json(data, source)
    head = doc.get(HEADER_KEY) if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not isinstance(head, dict) or "body" not in doc:
        found = sorted(map(str, doc))[:10] if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{source}: expected an fsdp_optim manifest (keys '{HEADER_KEY}' and 'body'), found {found}")
    version = _check_head(head, source)
    if version == CHECKPOINT_VERSION:
        raise ValueError(
            f"{source}: checksum mismatch in the manifest: a version-{version} manifest is checked on its bytes as "
            "written (one line: header, then body); this one was reformatted or modified"
        )
    try:
        canonical = json.dumps(doc["body"], sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"{source}: the body is not exact JSON ({exc})") from None
    if not digest_matches(canonical, head.get("checksum")):
        raise ValueError(f"{source}: checksum mismatch in the manifest (file is corrupt or was modified)")
    return _manifest(from_json(doc["body"], source), version, source)


def _json(data: str | bytes, source: str) -> JSONValue:
    try:
        return loads(data, where=source, parse_constant=_refuse_constant)
    except RefusedJSON:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{source}: not a JSON manifest ({escape(str(exc), limit=200)})") from None


def _check_head(head: object, source: str) -> int:
    if not isinstance(head, dict) or head.get("kind") != "manifest":
        kind = head.get("kind") if isinstance(head, dict) else head
        raise ValueError(f"{source}: expected an fsdp_optim manifest, found a {escape(repr(kind), limit=80)} file")
    version = head.get("version")
    if type(version) is not int or version not in JSON_VERSIONS:
        raise ValueError(
            f"{source}: format version {escape(repr(version), limit=80)}, but this fsdp_optim reads "
            f"manifest.json of versions {', '.join(map(str, JSON_VERSIONS))} (and manifest.pt of version 1)"
        )
    return version


def _read_as_written(data: bytes, start: int, head: dict[str, Any], source: str) -> Manifest:
    """A format-3 body (``data[start:-2]``): its checksum checked on its bytes, then parsed once, tagged values
    restored as parsed. Memory: ``data``, the body's text once (a str), and what it parses to."""
    version = _check_head(head, source)
    if not text_digest_matches(data, head.get("checksum"), start, len(data) - 2):
        raise ValueError(f"{source}: checksum mismatch in the manifest (file is corrupt or was modified)")
    try:
        body = str(memoryview(data)[start:-2], "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: not a JSON manifest ({escape(str(exc), limit=200)})") from None
    try:
        parsed = json.loads(body, object_pairs_hook=_tagged, parse_constant=_refuse_constant)
    except _Untagged:  # refused or unusual (a '$dict'): the general reader says where, or reads it
        parsed = from_json(_json(body, source), source)
    except DuplicateKeyError as exc:
        raise duplicate(exc, source) from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{source}: not a JSON manifest ({escape(str(exc), limit=200)})") from None
    check_depth(parsed, f"{source}: the body")
    return _manifest(parsed, version, source)


def _manifest(body: object, version: int, source: str) -> Manifest:
    if not isinstance(body, dict) or body.get("version") != version:
        found = repr(body.get("version")) if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"{source}: the body's version is {found}, expected {version} (as its header says)")
    return Manifest.from_dict(body, source=source)


class _Untagged(Exception):
    """An object the parsing hook leaves to :func:`from_json` (which refuses it with its place, or reads it)."""


def _tagged(pairs: list[tuple[str, Any]]) -> object:
    """:func:`from_json` of one object while parsing, its members restored already (innermost first), each
    key once."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        unique_object(pairs)  # raises, naming the key
    if not has_reserved_key(obj):
        return obj
    if len(obj) != 1 or "$dict" in obj:
        raise _Untagged
    try:
        return from_json(obj, "manifest")
    except ValueError:
        raise _Untagged from None


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"non-standard constant {name} (exact JSON writes non-finite floats as {{'$float': ...}})")
