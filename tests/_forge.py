"""Writers that follow the documented checkpoint format (fsdp_optim/manifest.py) and put the wrong thing
in it, checksums recomputed, so that only fsdp_optim's own checks can tell. Shared by the refusal
catalogue (test_disk_refusals.py) and the adversarial suite (_attacks.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.checksums import digest
from fsdp_optim.formats.sharded.manifest import HEADER_KEY, MANIFEST_NAME, unwrap


def forge_manifest(directory: Path, edit: Callable[[dict[str, Any]], None], *, version: int = 1) -> None:
    """Rewrite ``directory``'s manifest with ``edit`` applied to its body, checksum recomputed."""
    path = directory / MANIFEST_NAME
    _, body = unwrap(torch.load(path, weights_only=True), "manifest", source=str(path))
    edit(body)
    head = {"kind": "manifest", "version": version}
    torch.save({HEADER_KEY: {**head, "checksum": digest([head, body])}, "body": body}, path)


def manifest_rank_file(directory: Path, rank: int) -> Path:
    """Rank ``rank``'s file as the manifest names it (read raw: the manifest may be forged already)."""
    _, body = unwrap(torch.load(directory / MANIFEST_NAME, weights_only=True), "manifest", source="")
    return directory / next(f["file"] for f in body["files"] if f["rank"] == rank)


def forge_rank_file(
    directory: Path, rank: int, edit: Callable[[dict[int, dict[str, Any]]], None] = lambda state: None, **header: Any
) -> None:
    """Rewrite one rank file with ``edit`` applied to its state (and ``header`` fields replaced), every
    checksum recomputed, and the manifest's record of the file updated to match."""
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
