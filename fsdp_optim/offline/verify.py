"""``verify``: check every file of a checkpoint end to end, one verdict per file, changing nothing.

- a sharded checkpoint of ours: the manifest (its own checksum), then per rank file: present, its size the
  manifest's, the header's checksum the manifest's, and every byte of state against its checksum (format 2:
  every chunk's; format 1: every zip record's CRC-32 and every unit's digest), each file read once, into
  memory, and released; a whole checkpoint's side files too (present, of the manifest's size, the digest of
  all their bytes the manifest's, their buffers and extra readable);
- a fairseq/metaseq shard set: every ``-shard<r>.pt`` file of ranks 0..N-1 present, every zip record's
  CRC-32, each file readable (``weights_only``) with its optimizer state and FSDP metadata, and the set
  consistent (one save, one model);
- any other file (a full dict, a fairscale-native dict, a layout file): its zip records' CRC-32 and the
  reading gate of :mod:`fsdp_optim.disk.untrusted`.

A damaged file is reported, not raised: :attr:`Verification.ok` is false and the file's
:class:`FileCheck` says what is wrong (missing, ``truncated: 3000 of 6985 bytes``, a checksum). A path that
is no checkpoint at all raises as the readers do (``FileNotFoundError``, ``ValueError``).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_optim.disk.atomic import load_file
from fsdp_optim.formats.fairseq.files import load_shard, shard_paths, summarise
from fsdp_optim.formats.kinds import Kind, path_kind
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint, checkpoint_dir
from fsdp_optim.formats.sharded.side_file import read_side_file

__all__ = ["FileCheck", "Verification", "present_and_sized", "verify"]


@dataclass(frozen=True)
class FileCheck:
    """One file's verdict: ``detail`` starts with ``ok`` or says what is wrong."""

    path: Path
    ok: bool
    detail: str


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: one :class:`FileCheck` per file, and problems of the whole (``problems``)."""

    path: Path
    kind: str
    files: tuple[FileCheck, ...]
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and all(f.ok for f in self.files)

    def lines(self) -> list[str]:
        """The report: one line per file (``name: ok ...`` or ``name: what is wrong``), then the problems."""
        return [f"{f.path.name}: {f.detail}" for f in self.files] + list(self.problems)

    def damaged(self) -> list[str]:
        """One line per problem, each naming its file."""
        return [f"{f.path}: {f.detail}" for f in self.files if not f.ok] + list(self.problems)


def verify(path: str | os.PathLike[str], *, allow_globals: Sequence[str] = ()) -> Verification:
    """Check every file of the checkpoint at ``path`` (see the module docstring); nothing is written.

    ``allow_globals``: for a shard set, classes its ``cfg`` may hold (as ``ShardSet`` takes them).
    """
    kind = path_kind(path)
    if kind is Kind.SHARD_SET:
        return _verify_shards(Path(path), tuple(allow_globals))
    if kind is Kind.SHARDED:
        return _verify_sharded(Path(path))
    check = _check_file(Path(path), lambda p: load_file(p, mmap=True))
    return Verification(Path(path), "file", (check,))


def present_and_sized(path: str | os.PathLike[str]) -> list[str]:
    """The cheap part of :func:`verify` for a sharded checkpoint: its rank files present with the manifest's
    sizes (one ``stat`` each); one line per damaged file, naming it."""
    directory = checkpoint_dir(path)
    manifest = ShardedCheckpoint(directory, lazy=True).manifest
    side = manifest.training.files if manifest.training is not None else ()
    checks = [
        _check_file(directory / f.file, lambda _: None, nbytes=f.nbytes, sizes_only=True)
        for f in (*manifest.files, *side)
    ]
    return [f"{c.path.name}: {c.detail}" for c in checks if not c.ok]


def _zip_problem(path: Path) -> str | None:
    """Every record's CRC-32 against the zip's central directory (reads every byte once)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return f"not a readable zip file ({type(exc).__name__}: {exc})"
    return None if bad is None else f"zip record '{bad}' fails its CRC-32 checksum (the bytes were changed)"


def _check_file(
    path: Path, read: Callable[[Path], object], *, nbytes: int | None = None, sizes_only: bool = False
) -> FileCheck:
    """Presence, size (against ``nbytes`` when known), zip CRCs, then ``read(path)``; never raises for damage."""
    if not os.path.lexists(path):
        expected = f" ({nbytes} bytes)" if nbytes is not None else ""
        return FileCheck(path, False, f"missing{expected}")
    if not path.is_file():
        return FileCheck(path, False, "not a regular file")
    size = path.stat().st_size
    if nbytes is not None and size != nbytes:
        what = "truncated: " if size < nbytes else ""
        return FileCheck(path, False, f"{what}{size} of {nbytes} bytes (the size the manifest records)")
    if sizes_only:
        return FileCheck(path, True, f"ok: {size} bytes")
    # torch.save files are zips with a CRC-32 per record; format-2 and -3 rank files are safetensors, whose chunk
    # checksums (in the manifest, format 2; in the file's header, format 3) the read below verifies.
    problem = None if path.suffix == ".safetensors" else _zip_problem(path)
    if problem is not None:
        return FileCheck(path, False, problem)
    try:
        detail = read(path)
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        return FileCheck(path, False, str(exc).removeprefix(f"{path}: ").removeprefix(f"{path}, "))
    return FileCheck(path, True, f"ok: {size} bytes{detail if isinstance(detail, str) else ''}")


def _verify_sharded(path: Path) -> Verification:
    directory = checkpoint_dir(path)
    manifest_path = directory / MANIFEST_NAME
    try:
        ckpt = ShardedCheckpoint(directory, lazy=True)
    except (ValueError, OSError) as exc:
        detail = str(exc).removeprefix(f"{manifest_path}: ")
        return Verification(directory, "sharded checkpoint", (FileCheck(manifest_path, False, detail),))
    manifest = ckpt.manifest
    checks = [FileCheck(manifest_path, True, f"ok: manifest of {len(manifest.files)} rank files, checksum matches")]
    with ckpt:
        for record in manifest.files:

            def read(_: Path, rank: int = record.rank) -> str:
                units = ckpt.load_rank(rank)
                return f", {len(units)} units, checksums match"

            checks.append(_check_file(directory / record.file, read, nbytes=record.nbytes))
    for side in manifest.training.files if manifest.training is not None else ():

        def read_side(_: Path, record: FileRecord = side) -> str:
            buffers, _extra = read_side_file(directory, record)
            return f", side file of rank {record.rank}: {len(buffers)} buffers and extra, checksum matches"

        checks.append(_check_file(directory / side.file, read_side, nbytes=side.nbytes))
    return Verification(directory, "sharded checkpoint", tuple(checks))


def _verify_shards(path: Path, allow_globals: tuple[str, ...]) -> Verification:
    from fsdp_optim.formats.fairseq.checks import check_same_save

    prefix, paths = shard_paths(path)  # a missing rank in the middle raises, naming the file
    summaries = []

    def read(p: Path) -> str:
        summaries.append(summarise(load_shard(p, allow_globals=allow_globals), p))
        return ", optimizer state and FSDP metadata read"

    checks = tuple(_check_file(p, read) for p in paths)
    problems: tuple[str, ...] = ()
    if all(c.ok for c in checks):
        try:
            check_same_save(summaries)
        except ValueError as exc:
            problems = (str(exc),)
    return Verification(prefix, "fairseq/metaseq shard set", checks, problems)
