"""``manifest.json``: a :class:`Manifest` as an exact, checksummed JSON document (format 2), and back.

Pure: bytes in, bytes out. The document::

    {"fsdp_optim_checkpoint": {"kind": "manifest", "version": 2, "checksum": "xxh3-128:..."},
     "body": to_json(Manifest.to_dict())}

The checksum is the digest of the body's canonical text (``json.dumps(body, sort_keys=True,
separators=(",", ":"), allow_nan=False)``), which parsing and dumping again reproduces exactly, so a
reader verifies it without trusting the file's own spacing or key order.
"""

from __future__ import annotations

import json
from typing import Any

from fsdp_optim.core.checksums import digest, digest_matches
from fsdp_optim.disk.text import escape
from fsdp_optim.formats.sharded.json_values import from_json, to_json
from fsdp_optim.formats.sharded.manifest import CHECKPOINT_VERSION, HEADER_KEY, Manifest

__all__ = ["MAX_MANIFEST_BYTES", "manifest_from_json", "manifest_to_json"]

MAX_MANIFEST_BYTES = 1 << 30  # ~20M chunk checksums: far above any real checkpoint's manifest


def _canonical(body: Any) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


def manifest_to_json(manifest: Manifest) -> bytes:
    """The document of ``manifest`` (format 2); ``ValueError`` names a value JSON cannot hold exactly."""
    if manifest.version != CHECKPOINT_VERSION:
        raise ValueError(f"manifest: version {manifest.version}; a JSON manifest is format {CHECKPOINT_VERSION}")
    body = to_json(manifest.to_dict(), "manifest")
    head = {"kind": "manifest", "version": CHECKPOINT_VERSION, "checksum": digest(_canonical(body))}
    return json.dumps({HEADER_KEY: head, "body": body}, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def manifest_from_json(data: bytes, *, source: str) -> Manifest:
    """Parse and check a ``manifest.json`` read from ``source`` (named in every error)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{source}: {len(data)} bytes, above the bound for a manifest ({MAX_MANIFEST_BYTES})")
    try:
        doc = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{source}: not a JSON manifest ({escape(str(exc), limit=200)})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(HEADER_KEY), dict) or "body" not in doc:
        found = sorted(map(str, doc))[:10] if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{source}: expected an fsdp_optim manifest (keys '{HEADER_KEY}' and 'body'), found {found}")
    head = doc[HEADER_KEY]
    if head.get("kind") != "manifest":
        raise ValueError(
            f"{source}: expected an fsdp_optim manifest, found a "
            f"{escape(repr(head.get('kind')), limit=80)} file"
        )
    if head.get("version") != CHECKPOINT_VERSION or type(head.get("version")) is not int:
        raise ValueError(
            f"{source}: format version {escape(repr(head.get('version')), limit=80)}, but this fsdp_optim reads "
            f"manifest.json of version {CHECKPOINT_VERSION} (and manifest.pt of version 1)"
        )
    try:
        canonical = _canonical(doc["body"])
    except ValueError as exc:
        raise ValueError(f"{source}: the body is not exact JSON ({exc})") from None
    if not digest_matches(canonical, head.get("checksum")):
        raise ValueError(f"{source}: checksum mismatch in the manifest (file is corrupt or was modified)")
    body = from_json(doc["body"], source)
    if not isinstance(body, dict) or body.get("version") != CHECKPOINT_VERSION:
        found = repr(body.get("version")) if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"{source}: the body's version is {found}, expected {CHECKPOINT_VERSION} (as its header says)")
    return Manifest.from_dict(body, source=source)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name} (exact JSON writes non-finite floats as {{'$float': ...}})")
