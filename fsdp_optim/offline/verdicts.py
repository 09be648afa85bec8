"""``verify``'s checks of one kind of input, file by file (the classes of :mod:`fsdp_optim.offline.opened` pick
theirs: :meth:`~fsdp_optim.offline.opened.Opened.verify_files`). Each reads what it checks once and reports,
never raises, what is damaged (:class:`~fsdp_optim.disk.file_check.FileCheck`); an input that ``verify`` cannot
check on its own (a DCP directory, one rank file) is refused with ``ValueError`` saying what to do instead.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from fsdp_optim.disk.file_check import Verification, check_file
from fsdp_optim.disk.objects import check_tree
from fsdp_optim.disk.untrusted import load_file
from fsdp_optim.formats.fairseq.files import load_shard, summarise
from fsdp_optim.formats.fairseq.paths import shard_paths
from fsdp_optim.formats.kinds import Kind, loaded_kind
from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.whole_file import TIED_KEY

__all__ = ["layout_file", "named_file", "shard_set", "torch_file"]


def torch_file(file: Path) -> Verification:
    """Any other file (a full dict, a fairscale-native dict, consolidate's whole file, a format-1 layout file): its
    zip records' CRC-32 and the reading gate of :mod:`fsdp_optim.disk.untrusted`. An intact file that is no
    checkpoint (a model's ``state_dict()``, any other ``torch.save`` file) is refused as ``inspect`` refuses it."""
    found: list[str] = []
    refused: list[Exception] = []
    check = check_file(file, partial(_read_torch, found=found, refused=refused))
    if refused:
        raise refused[0]
    return Verification(file, found[0] if found else "file", (check,))


def named_file(file: Path) -> Verification:
    """A named safetensors file: its header and document, then every checksum it records."""
    return Verification(file, Kind.NAMED.value, (check_file(file, _read_named, zipped=False),))


def layout_file(file: Path) -> Verification:
    """A layout file (JSON): its manifest checks (its own checksum, its records)."""
    return Verification(file, Kind.LAYOUT.value, (check_file(file, _read_layout, zipped=False),))


def shard_set(path: Path, allow_globals: tuple[str, ...]) -> Verification:
    """A fairseq/metaseq shard set: every rank's file present and readable, and the set one save of one model."""
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


def _read_torch(path: Path, *, found: list[str], refused: list[Exception]) -> str:
    """A torch file through the reading gate, its kind decided as ``inspect`` decides it (into ``found``; a file
    that is no checkpoint: the refusal into ``refused``, not damage), then its tensors checked as its readers check
    them (a tied parameter of consolidate's whole file read once)."""
    obj = load_file(path, mmap=True, shared=True)
    try:
        kind = loaded_kind(obj, str(path))
    except (ValueError, TypeError) as exc:
        refused.append(exc)
        return ""
    check_tree(obj, str(path), disjoint=True, tied=TIED_KEY)
    found.append(kind.value)
    return ""


def _read_named(path: Path) -> str:
    with NamedSafetensors(path) as named:
        count = named.check_every_checksum()
    return f", {count} tensors, checksums match"


def _read_layout(path: Path) -> str:
    manifest = read_manifest(path)
    return f", layout of {len(manifest.param_order)} params, checksum matches"
