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
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from fsdp_optim.core.checksums import digest, digest_matches, text_digest_matches
from fsdp_optim.disk.json_input import DuplicateKeyError, RefusedJSON, check_depth, duplicate, loads, unique_object
from fsdp_optim.disk.text import escape
from fsdp_optim.formats.sharded.file_record import CHECKPOINT_VERSION, HEADER_KEY
from fsdp_optim.formats.sharded.json_values import JSONValue, from_json, has_reserved_key, to_json
from fsdp_optim.formats.sharded.manifest import Manifest

__all__ = ["MAX_MANIFEST_BYTES", "manifest_from_json", "manifest_to_json"]

JSON_VERSIONS = (2, CHECKPOINT_VERSION)  # format 1 wrote manifest.pt
MAX_MANIFEST_BYTES = 64 << 20  # a 1,024-rank, 1,000-unit manifest is 0.1-20 MiB (docs/threat-model.md, "Bounds")
_WRITTEN = re.compile(rb'\A\{"' + HEADER_KEY.encode() + rb'":(\{[^{}]*\}),"body":')


def _canonical(body: object) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


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
        canonical = _canonical(doc["body"])
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
