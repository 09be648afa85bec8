"""``verify``: check every file of a checkpoint end to end, one verdict per file, changing nothing: every byte
against the checksums its kind records (a sharded checkpoint: :mod:`fsdp_optim.formats.sharded.steps`;
a shard set, a named safetensors file, a layout file and any torch file: :mod:`fsdp_optim.offline.verdicts`).

The kind of a file comes from :func:`fsdp_optim.formats.kinds.sniff_kind` (names and first bytes), as
:func:`~fsdp_optim.formats.kinds.detect` decides it; its class in :mod:`fsdp_optim.offline.opened` checks it
(``verify_files``, with the checks of :mod:`fsdp_optim.offline.verdicts`). A safetensors rank file alone is
refused (``ValueError``): it is checked against its checkpoint's manifest, so verify the checkpoint directory.

A damaged file is reported, not raised: :attr:`Verification.ok` is false and the file's
:class:`~fsdp_optim.disk.file_check.FileCheck` says what is wrong (missing, ``truncated: 3000 of 6985 bytes``, a
checksum). A path that is no checkpoint at all raises as the readers do (``FileNotFoundError``, ``ValueError``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

from fsdp_optim.disk.file_check import Verification
from fsdp_optim.formats.kinds import Kind, path_kind, sniff_kind
from fsdp_optim.offline.deep import deep_findings
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.opened import class_of
from fsdp_optim.offline.sources import fetched_whole

__all__ = ["report_json", "verify"]

JSON_SCHEMA = 1


def verify(
    path: str | os.PathLike[str],
    *,
    allow_globals: Sequence[str] = (),
    deep: bool = False,
    layout: LayoutLike | None = None,
    parallel: bool = False,
) -> Verification:
    """Check every file of the checkpoint at ``path`` (see the module docstring); nothing is written.

    ``allow_globals``: for a shard set, classes its ``cfg`` may hold (as ``ShardSet`` takes them). ``deep``: also
    read the state for what a resumed run would trip on (only when every file is intact); ``layout`` (deep only):
    the model's layout (a sharded checkpoint or layout file of it) to check parameters and shapes against.
    ``parallel``: every process of the process group (or torchrun's) calls it alike; a local sharded checkpoint's
    files are then split across them, and so is ``deep``'s reading of the state
    (:mod:`fsdp_optim.offline.parallel.verify`); any other input is checked whole by every process.
    """
    if layout is not None and not deep:
        raise ValueError("layout: applies to a deep verification only (deep=True, --deep)")
    if parallel:
        from fsdp_optim.offline.parallel.entry import joined_team, splits

        if splits("verify", path):  # (in any location: each process reads its share)
            from fsdp_optim.offline.parallel.verify import verify_across

            team = joined_team()
            try:
                return verify_across(team, path, deep=deep, allow_globals=allow_globals, layout=layout)
            finally:
                team.close()
    with fetched_whole(path) as local:  # a URL of one object: downloaded once, for the files and the state
        # by its names and first bytes (it may be damaged), checked as its kind checks them
        checked = class_of(path_kind(local) or sniff_kind(local)).verify_files(local, tuple(allow_globals))
        if not deep or not checked.ok:
            return replace(checked, deep=deep)
        return replace(checked, deep=True, findings=deep_findings(local, allow_globals=allow_globals, layout=layout))


def report_json(report: Verification) -> dict[str, object]:
    """``verify --json``: the report as one object whose ``kind`` means what ``inspect --json``'s does (the input's
    kind, ``sharded``, ``full``, ``shard_set``...; ``null`` for a file too damaged to say) and ``format`` is the text's
    format line (documented in docs/cli.md)."""
    body = report.to_json()
    path, text = body.pop("path"), body.pop("kind")
    return {"schema": JSON_SCHEMA, "path": path, "kind": _kind_name(report.kind), "format": text, **body}


def _kind_name(text: str) -> str | None:
    """The :class:`~fsdp_optim.formats.kinds.Kind` a verification names in its text, as ``inspect --json`` spells it."""
    for kind in Kind:
        if text in (kind.value, f"whole {kind.value} (model, optimizer, extra)"):
            return kind.name.lower()
    return None
