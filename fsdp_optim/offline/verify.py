"""``verify``: check every file of a checkpoint end to end, one verdict per file, changing nothing.

- a sharded checkpoint of ours: the manifest (its own checksum), then per rank file: present, its size the
  manifest's, the header's checksum the manifest's, and every byte of state against its checksum (format 2:
  every chunk's; format 1: every zip record's CRC-32 and every unit's digest), and a whole checkpoint's side
  files against their digests, each file read once, into memory, and released
  (:mod:`fsdp_optim.formats.sharded.verification`);
- a fairseq/metaseq shard set: every ``-shard<r>.pt`` file of ranks 0..N-1 present, every zip record's
  CRC-32, each file readable (``weights_only``) with its optimizer state and FSDP metadata, and the set
  consistent (one save, one model);
- a named safetensors file of ours (``to_safetensors``, ``convert --to safetensors``): its header and
  document, then every tensor's chunk checksums and whole digest;
- a layout file (JSON, ``save_layout``): its manifest checks (its own checksum);
- any other file (a full dict, a fairscale-native dict, consolidate's file of a whole checkpoint, a format-1 layout
  file): its zip records' CRC-32 and the reading gate of :mod:`fsdp_optim.disk.untrusted`.

The kind of a file comes from :func:`fsdp_optim.formats.kinds.sniff_kind` (names and first bytes), as
:func:`~fsdp_optim.formats.kinds.detect` decides it. A safetensors rank file alone is refused (``ValueError``):
it is checked against its checkpoint's manifest, so verify the checkpoint directory.

A damaged file is reported, not raised: :attr:`Verification.ok` is false and the file's
:class:`FileCheck` says what is wrong (missing, ``truncated: 3000 of 6985 bytes``, a checksum). A path that
is no checkpoint at all raises as the readers do (``FileNotFoundError``, ``ValueError``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from fsdp_optim.disk.atomic import load_file
from fsdp_optim.disk.file_check import FileCheck, Verification, check_file
from fsdp_optim.formats.fairseq.files import summarise
from fsdp_optim.formats.fairseq.loading import load_shard
from fsdp_optim.formats.fairseq.paths import shard_paths
from fsdp_optim.formats.kinds import Kind, path_kind, sniff_kind
from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors
from fsdp_optim.formats.sharded.reader import read_manifest
from fsdp_optim.formats.sharded.verification import present_and_sized, verify_sharded
from fsdp_optim.formats.whole_file import TIED_KEY, is_whole_file
from fsdp_optim.offline.deep import Finding, deep_findings
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.sources import fetched_whole

__all__ = ["FileCheck", "Finding", "Verification", "present_and_sized", "verify"]


def verify(
    path: str | os.PathLike[str],
    *,
    allow_globals: Sequence[str] = (),
    deep: bool = False,
    layout: LayoutLike | None = None,
) -> Verification:
    """Check every file of the checkpoint at ``path`` (see the module docstring); nothing is written.

    ``allow_globals``: for a shard set, classes its ``cfg`` may hold (as ``ShardSet`` takes them). ``deep``: also
    read the state for what a resumed run would trip on (only when every file is intact); ``layout`` (deep only):
    the model's layout (a sharded checkpoint or layout file of it) to check parameters and shapes against.
    """
    if layout is not None and not deep:
        raise ValueError("layout: applies to a deep verification only (deep=True, --deep)")
    with fetched_whole(path) as local:  # a URL of one object: downloaded once, for the files and the state
        checked = _verify_files(local, tuple(allow_globals))
        if not deep or not checked.ok:
            return replace(checked, deep=deep)
        return replace(checked, deep=True, findings=deep_findings(local, allow_globals=allow_globals, layout=layout))


def _verify_files(path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:
    kind = path_kind(path)
    if kind is Kind.SHARD_SET:
        return _verify_shards(Path(path), allow_globals)
    if kind is Kind.SHARDED:
        return verify_sharded(path)
    if kind is Kind.DCP:
        raise ValueError(
            f"{path}: a {kind.value}, which records no checksums to verify; fsdp-optim inspect {path} reads its "
            "metadata, and torch.distributed.checkpoint.load reads its data"
        )
    file = Path(path)
    kind = sniff_kind(file)
    if kind is Kind.RANK_FILE:
        raise ValueError(
            f"{file}: a rank file of a sharded checkpoint is checked against its manifest; verify the checkpoint "
            f"directory ({file.parent}) instead"
        )
    if kind is Kind.NAMED:
        return Verification(file, kind.value, (check_file(file, _read_named, zipped=False),))
    if kind is Kind.LAYOUT:
        return Verification(file, kind.value, (check_file(file, _read_layout, zipped=False),))
    found: list[str] = []
    check = check_file(file, partial(_read_torch, found=found))
    return Verification(file, found[0] if found else "file", (check,))


def _read_torch(path: Path, *, found: list[str]) -> str:
    """A torch file through the reading gate (a tied parameter of consolidate's whole file read once); what it
    holds goes to ``found`` (consolidate's file of a whole checkpoint, or a file)."""
    obj = load_file(path, mmap=True, tied=TIED_KEY)
    found.append(Kind.WHOLE_FILE.value if is_whole_file(obj) else "file")
    return ""



def _read_named(path: Path) -> str:
    """A named safetensors file's header and document, then every checksum it records."""
    with NamedSafetensors(path) as named:
        count = named.check_every_checksum()
    return f", {count} tensors, checksums match"


def _read_layout(path: Path) -> str:
    """A layout file's manifest checks (its own checksum, its records)."""
    manifest = read_manifest(path)
    return f", layout of {len(manifest.param_order)} params, checksum matches"


def _verify_shards(path: Path, allow_globals: tuple[str, ...]) -> Verification:
    from fsdp_optim.formats.fairseq.checks import check_same_save

    prefix, paths = shard_paths(path)  # a missing rank in the middle raises, naming the file
    summaries = []

    def read(p: Path) -> str:
        summaries.append(summarise(load_shard(p, allow_globals=allow_globals), p))
        return ", optimizer state and FSDP metadata read"

    checks = tuple(check_file(p, read) for p in paths)
    problems: tuple[str, ...] = ()
    if all(c.ok for c in checks):
        try:
            check_same_save(summaries)
        except ValueError as exc:
            problems = (str(exc),)
    return Verification(prefix, "fairseq/metaseq shard set", checks, problems)
