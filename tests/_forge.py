"""Writers that follow the documented checkpoint formats (fsdp_optim/formats/sharded/manifest.py) and put the wrong
thing in them, checksums recomputed, so that only fsdp_optim's own checks can tell. Shared by the refusal
catalogue (test_disk_refusals.py) and the adversarial suite (_attacks.py).

Format 1 (``manifest.pt`` and torch rank files): :func:`forge_manifest`, :func:`forge_rank_file`, and
:func:`to_format1`, which rewrites a checkpoint saved today (format 2) as format 1, the way fsdp_optim
before format 2 wrote it, so that the cases forging format-1 files keep forging them. Format 2
(``manifest.json`` and safetensors rank files): :func:`forge_manifest_json`, :func:`forge_safetensors`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.checksums import digest
from fsdp_optim.formats.sharded.file_record import HEADER_KEY, FileRecord
from fsdp_optim.formats.sharded.legacy import TORCH_FILE_VERSION, unwrap
from fsdp_optim.formats.sharded.manifest import LEGACY_MANIFEST_NAME, MANIFEST_NAME, shard_file_name
from fsdp_optim.formats.sharded.manifest_json import from_json, to_json
from fsdp_optim.formats.sharded.reader import open_checkpoint

V1_MANIFEST = LEGACY_MANIFEST_NAME


def wrap(kind: str, body: Any, **header: Any) -> dict[str, Any]:
    """A format-1 torch file: ``{HEADER_KEY: {"kind", "version", "checksum", **header}, "body": body}``; the
    checksum covers both."""
    head = {"kind": kind, "version": TORCH_FILE_VERSION, **header}
    return {HEADER_KEY: {**head, "checksum": digest([head, body])}, "body": body}


def shard_payload(
    state: Mapping[int, Mapping[str, Any]], *, save_id: str, rank: int, world_size: int
) -> tuple[dict[str, Any], str]:
    """A format-1 rank file's content and its checksum (which the manifest also records)."""
    unit_checksums = {i: digest(entries) for i, entries in state.items()}
    head = {"kind": "shard", "version": TORCH_FILE_VERSION, "save_id": save_id, "rank": rank, "world_size": world_size}
    checksum = digest([head, unit_checksums])
    payload = {HEADER_KEY: {**head, "checksum": checksum}, "unit_checksums": unit_checksums, "state": dict(state)}
    return payload, checksum


# --- format 1 --------------------------------------------------------------------------------------------


def to_format1(directory: Path) -> None:
    """Rewrite the format-2 checkpoint in ``directory`` as format 1 (same state, same save id)."""
    with open_checkpoint(directory, lazy=False) as ckpt:
        manifest = ckpt.manifest
        records = []
        for f in manifest.files:
            state = ckpt.load_rank(f.rank)
            payload, checksum = shard_payload(state, save_id=manifest.save_id, rank=f.rank, world_size=manifest.world_size)
            name = shard_file_name(manifest.save_id, f.rank, manifest.world_size, version=1)
            torch.save(payload, directory / name)
            records.append(FileRecord(f.rank, name, checksum, (directory / name).stat().st_size))
    old = replace(manifest, version=1, files=tuple(records))
    torch.save(wrap("manifest", old.to_dict()), directory / V1_MANIFEST)
    for f in manifest.files:
        (directory / f.file).unlink()
    (directory / MANIFEST_NAME).unlink()


def forge_manifest(directory: Path, edit: Callable[[dict[str, Any]], None], *, version: int = 1) -> None:
    """Rewrite ``directory``'s format-1 manifest with ``edit`` applied to its body, checksum recomputed."""
    path = directory / V1_MANIFEST
    _, body = unwrap(torch.load(path, weights_only=True), "manifest", source=str(path))
    edit(body)
    head = {"kind": "manifest", "version": version}
    torch.save({HEADER_KEY: {**head, "checksum": digest([head, body])}, "body": body}, path)


def manifest_rank_file(directory: Path, rank: int) -> Path:
    """Rank ``rank``'s file as the manifest names it (read raw: the manifest may be forged already)."""
    if (directory / MANIFEST_NAME).exists():
        body = json.loads((directory / MANIFEST_NAME).read_text())["body"]
    else:
        _, body = unwrap(torch.load(directory / V1_MANIFEST, weights_only=True), "manifest", source="")
    return directory / next(f["file"] for f in body["files"] if f["rank"] == rank)


def forge_rank_file(
    directory: Path, rank: int, edit: Callable[[dict[int, dict[str, Any]]], None] = lambda state: None, **header: Any
) -> None:
    """Rewrite one format-1 rank file with ``edit`` applied to its state (and ``header`` fields replaced),
    every checksum recomputed, and the manifest's record of the file updated to match."""
    path = manifest_rank_file(directory, rank)
    payload = torch.load(path, weights_only=True)
    state = {i: dict(entries) for i, entries in payload["state"].items()}
    edit(state)
    head = {k: v for k, v in payload[HEADER_KEY].items() if k != "checksum"} | header
    unit_checksums = {i: digest(entries) for i, entries in state.items()}
    checksum = digest([head, unit_checksums])
    torch.save({HEADER_KEY: {**head, "checksum": checksum}, "unit_checksums": unit_checksums, "state": state}, path)

    def record(body: dict[str, Any]) -> None:
        entry = next(f for f in body["files"] if f["rank"] == rank)
        entry.update(checksum=checksum, bytes=path.stat().st_size)

    forge_manifest(directory, record)


# --- format 2 --------------------------------------------------------------------------------------------


def _canonical(body: Any) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


def forge_manifest_json(directory: Path, edit: Callable[[Any], object], *, raw: bool = False) -> None:
    """Rewrite ``directory``'s ``manifest.json`` with ``edit`` applied to its body, checksum recomputed.

    ``edit`` gets the body as ``Manifest.to_dict()`` gives it (tuples, tensors), or with ``raw=True`` as
    JSON values (to write what no encoder would: a string where an int belongs, an unknown tag), and
    edits it in place (what it returns is ignored).
    """
    path = directory / MANIFEST_NAME
    doc = json.loads(path.read_text())
    body = doc["body"] if raw else from_json(doc["body"], "body")
    edit(body)
    body = body if raw else to_json(body, "body")
    head = doc[HEADER_KEY]
    if head.get("version") == 2:  # format 2: the checksum covers the body's canonical text
        head["checksum"] = digest(_canonical(body))
        path.write_text(json.dumps({HEADER_KEY: head, "body": body}))
        return
    text = json.dumps(body, separators=(",", ":"))  # format 3: the body's bytes as written, on one line
    head["checksum"] = digest(text)
    path.write_text(f'{{"{HEADER_KEY}":{json.dumps(head, separators=(",", ":"))},"body":{text}}}\n')


def forge_manifest_text(directory: Path, edit: Callable[[str], str]) -> None:
    """Rewrite the body of ``directory``'s (format-3) ``manifest.json`` as text with ``edit``, checksum recomputed:
    what only a text edit can make (an integer too long to parse)."""
    path = directory / MANIFEST_NAME
    head, _, rest = path.read_text().partition(',"body":')
    body = edit(rest[:-2])  # the body, without the closing brace and newline
    doc_head = json.loads(head[len(f'{{"{HEADER_KEY}":') :])
    doc_head["checksum"] = digest(body)
    path.write_text(f'{{"{HEADER_KEY}":{json.dumps(doc_head, separators=(",", ":"))},"body":{body}}}\n')


def read_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def forge_safetensors(
    directory: Path,
    rank: int,
    edit: Callable[[dict[str, Any]], None] = lambda header: None,
    *,
    data: Callable[[bytes], bytes] = lambda data: data,
    header_length: int | None = None,
    text: Callable[[bytes], bytes] = lambda text: text,
) -> None:
    """Rewrite rank ``rank``'s format-2 file with ``edit`` applied to its header and ``data`` to its data;
    the manifest's record of the file (header checksum, size) is updated to match. ``header_length``
    replaces the declared length of the header (the bytes written stay the edited header's); ``text`` edits
    the header's JSON text (to write what no encoder would: a key twice)."""
    path = manifest_rank_file(directory, rank)
    header, payload = read_safetensors(path)
    edit(header)
    raw = text(json.dumps(header, separators=(",", ":")).encode())
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data(payload))

    def record(body: dict[str, Any]) -> None:
        entry = next(f for f in body["files"] if f["rank"] == rank)
        entry.update(checksum=digest(raw), bytes=os.path.getsize(path))

    forge_manifest_json(directory, record, raw=True)
