"""Our torch files, format 1 (``manifest.pt`` and ``optim-...-rankNNNNN-of-NNNNN.pt``): the checked header every
one of them starts with, and the rank file's content. Pure: no file access (:mod:`.reader` and :mod:`.legacy`
load the files; only the tests still write them, to check that format 1 stays readable: ``tests/_forge.py``).

A format-1 manifest is ``{HEADER_KEY: {"kind": "manifest", "version": 1, "checksum": ...}, "body": body}`` (the
checksum covers header and body; :func:`unwrap`). A format-1 rank file::

    {"fsdp_optim_checkpoint": {"kind": "shard", "version": 1, "save_id": ..., "rank": 0, "world_size": 2,
                               "checksum": "sha256:..."},       # digest of the header and unit_checksums
     "unit_checksums": {flat_index: "sha256:..."},              # digest of state[flat_index]
     "state": {flat_index: {"exp_avg": Tensor[shard_numel], "step": tensor(3.)}}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_optim.core.checksums import digest_matches
from fsdp_optim.core.preconditions import check_version
from fsdp_optim.formats.sharded.file_record import HEADER_KEY

__all__ = ["TORCH_FILE_VERSION", "check_checksum", "read_torch_header", "unwrap"]

TORCH_FILE_VERSION = 1  # the version in the header of the torch files of format 1 (and of layout files)


def unwrap(obj: Any, kind: str, *, source: str) -> tuple[dict[str, Any], Any]:
    """Check a wrapped torch file's content (a format-1 manifest, a layout file) read from ``source``; return
    ``(header, body)``."""
    header, checksum = read_torch_header(obj, kind, source=source, covered="body")
    check_checksum(header, checksum, obj["body"], source=source)
    return header, obj["body"]


def read_torch_header(
    obj: Any, kind: str, *, source: str, covered: str, what: str | None = None
) -> tuple[dict[str, Any], Any]:
    """The checked header of a file we wrote (kind and version; not yet the checksum): ``(header, checksum)``.

    ``covered`` is the key whose value the header's checksum covers besides the header itself.
    """
    what = what or f"fsdp_optim {kind} file"
    if not isinstance(obj, Mapping) or not isinstance(obj.get(HEADER_KEY), Mapping) or covered not in obj:
        raise ValueError(f"{source}: expected an {what}, found {_describe(obj)}")
    header = dict(obj[HEADER_KEY])
    if header.get("kind") != kind:
        raise ValueError(f"{source}: expected an {what}, found a {header.get('kind')!r} file")
    check_version(header.get("version"), source, TORCH_FILE_VERSION)
    return header, header.pop("checksum", None)


def _describe(obj: object) -> str:
    """What a file that is not ours holds, in the user's terms (a key list only for the unknown)."""
    if isinstance(obj, Mapping) and {"state", "param_groups"} <= set(obj):
        if "param_id_map" in obj:
            kind = "a fairscale-native dict (from fairscale's gather_full_optim_state_dict; convert it with a layout)"
        elif "param_names" in obj:
            kind = "already a full dict (what gather_full_optim_state_dict and consolidate write)"
        else:
            kind = "a plain optimizer state dict"
        return f"{kind} with keys ({', '.join(repr(str(k)) for k in obj)})"
    return str(sorted(map(str, obj))) if isinstance(obj, Mapping) else type(obj).__name__


def check_checksum(header: Mapping[str, Any], checksum: object, covered: object, *, source: str) -> None:
    """Refuse a file whose header checksum does not cover its header and ``covered`` value."""
    if not digest_matches([dict(header), covered], checksum):
        raise ValueError(f"{source}: checksum mismatch in the file header (file is corrupt or was modified)")

