"""Checkpoint files: atomic writes, ``weights_only`` reads with checks, and a memory-bounded shard reader.

Never imports ``torch.distributed``. Every file is read with ``torch.load(..., weights_only=True)``.

Writes go to a hidden temporary file in the target directory, are flushed and ``fsync``-ed, then renamed
over the final name, and the directory is ``fsync``-ed: a crash leaves either the old file or the new
one, never a torn one. A sharded checkpoint becomes visible only when its manifest is renamed into
place, and rank files carry the save's id in their names, so saving into a directory that already
holds a checkpoint never touches the files the old manifest points to until the new manifest exists.

:class:`ShardedCheckpoint` reads rank files with ``mmap=True`` and hands out one unit at a time; the
pages it has touched are released (the mappings dropped) whenever they exceed ``max_mapped_bytes``, so
a consumer that copies what it needs keeps its resident memory near its own output plus that bound.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .flatten import StateKind, same_scalar, show_value
from .locks import ForeignOutputError, OutputLock, lock_output, resolve_output
from .manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    check_checksum,
    digest_matches,
    dtype_from_str,
    read_header,
    shard_file_name,
    shard_payload,
    unwrap,
    wrap,
)
from .plan import Source
from .untrusted import MAX_WORLD_SIZE, check_stored_bytes, check_tree, describe_file, escape, load_untrusted

__all__ = [
    "DEFAULT_MAPPED_BYTES",
    "ShardedCheckpoint",
    "atomic_save",
    "begin_write",
    "check_not_input",
    "checkpoint_dir",
    "end_write",
    "is_sharded_checkpoint",
    "load_file",
    "new_save_id",
    "owned_files",
    "read_manifest",
    "recover",
    "remove_stale_files",
    "source_kind",
    "write_all_or_nothing",
    "write_file",
    "write_manifest",
    "write_shard_file",
]

DEFAULT_MAPPED_BYTES = 64 << 20
_SHARD_FILE = re.compile(r"^optim-[0-9a-f]+-rank\d+-of-\d+\.pt$")
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
# atomic_save's temporary names: ".<final>.tmp.<pid>.<8 hex>", or with a tag ".<final>.<12 hex>.tmp.<pid>.<8 hex>".
_TEMP = re.compile(r"^\.(?P<final>.+)\.tmp\.\d+\.[0-9a-f]{8}$")
_TAGGED_TEMP = re.compile(r"^\.(?P<final>.+)\.(?P<tag>[0-9a-f]{12})\.tmp\.\d+\.[0-9a-f]{8}$")


def new_save_id() -> str:
    return uuid.uuid4().hex


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | os.PathLike[str], *, tag: str | None = None) -> int:
    """``torch.save(obj)`` to ``path`` through a temporary file, fsync and rename. Returns the file's size.

    The temporary file is ``.<name>[.<tag>].tmp.<pid>.<random>`` beside ``path``, created exclusively
    (never through an existing file or symlink); a writer that journals ``tag`` before writing lets the
    next holder of its lock recognise the file if it is killed (:func:`begin_write`).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{f'.{tag}' if tag else ''}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    writer = None
    try:
        with open(tmp, "xb") as f:
            writer = _RecordingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        # torch.save's zip writer reports a failed write (disk full, file too large) as a bare
        # RuntimeError about stream positions; surface the operating system's error and the file.
        cause = exc if isinstance(exc, OSError) else (writer.error if writer is not None else None)
        if cause is not None and isinstance(exc, (OSError, RuntimeError)):
            raise OSError(cause.errno, f"{path}: cannot write the checkpoint file: {cause.strerror or cause}") from exc
        raise
    _fsync_dir(path.parent)
    return size


class _RecordingWriter:
    """A file object for ``torch.save`` that remembers the first ``OSError`` its writes raised."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._file.flush()


def load_file(path: str | os.PathLike[str], *, mmap: bool = False, follow_symlinks: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU through the gate of :mod:`fsdp_optim.untrusted`.

    Raises ``FileNotFoundError`` for nothing there, and ``ValueError`` naming the file for content that
    cannot be read, for a file that is not a regular file (a FIFO, a directory; a symlink where ``follow_symlinks=False``),
    exceeds a bound or holds what optimizer state does not (quantized, sparse, meta, complex tensors,
    overlapping or zero-stride views, cycles, nesting).
    """
    return load_untrusted(path, mmap=mmap, follow_symlinks=follow_symlinks)


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory of a sharded checkpoint given the directory or its manifest file."""
    path = Path(path)
    return path.parent if path.is_file() else path


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """``path`` is a directory holding a manifest, or a manifest file itself (judged by name, not read)."""
    path = Path(path)
    # lexists: a manifest.pt that is not a regular file is refused saying so when it is read.
    return os.path.lexists(path / MANIFEST_NAME) if path.is_dir() else path.name == MANIFEST_NAME and path.is_file()


def source_kind(path: str | os.PathLike[str]) -> str:
    """What a source path is: ``"sharded"`` (a checkpoint directory or its manifest) or ``"file"``.

    Raises ``FileNotFoundError`` for nothing there, ``ValueError`` for a directory without a manifest.
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        return "sharded"
    if path.is_dir():
        raise ValueError(
            f"{path}: not a sharded checkpoint directory, a directory without a {MANIFEST_NAME} (no {MANIFEST_NAME}: "
            "a save that never finished leaves none), and not a full dict file"
        )
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory (there is no such checkpoint directory or file)")
    return "file"


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and verify a manifest: ``path`` is a checkpoint directory, its manifest, or a layout file."""
    path = Path(path)
    file = path / MANIFEST_NAME if path.is_dir() else path
    if not os.path.lexists(file):
        if path.is_dir():
            raise ValueError(
                f"{path}: not a sharded checkpoint directory (no {MANIFEST_NAME}; a save that never finished leaves none)"
            )
        raise FileNotFoundError(f"{path}: no such checkpoint directory or file")
    obj = load_file(file)
    read_header(obj, "manifest", source=str(file), covered="body")  # its kind first, then what it holds
    check_tree(obj, str(file))
    _, body = unwrap(obj, "manifest", source=str(file))
    return Manifest.from_dict(body, source=str(file))


def write_shard_file(
    directory: Path, state: Mapping[int, Mapping[str, Any]], *, save_id: str, rank: int, world_size: int
) -> FileRecord:
    """Write one rank's file atomically; its record for the manifest."""
    payload, checksum = shard_payload(state, save_id=save_id, rank=rank, world_size=world_size)
    name = shard_file_name(save_id, rank, world_size)
    size = atomic_save(payload, directory / name)
    return FileRecord(rank, name, checksum, size)


def write_manifest(directory: Path, manifest: Manifest, *, replaces: Iterable[str] = ()) -> Path:
    """Commit a checkpoint: write its manifest atomically (last), then remove the rank files of the
    checkpoint it replaces (``replaces``: the previous manifest's files, from :func:`begin_write`)."""
    path = directory / MANIFEST_NAME
    atomic_save(wrap("manifest", manifest.to_dict()), path, tag=manifest.save_id[:12])
    remove_stale_files(directory, replaces, keep={f.file for f in manifest.files})
    return path


def remove_stale_files(directory: Path, names: Iterable[str], *, keep: set[str]) -> list[str]:
    """Delete ``names`` but ``keep`` from ``directory``: only rank-file names, only files (never a
    directory), never followed. ``names`` come from a manifest of ours or our lock's journal: a file
    this package did not record is never deleted, whatever its name."""
    removed = []
    for name in sorted(set(names) - keep):
        target = directory / name
        if _SHARD_FILE.match(name) and (target.is_symlink() or target.is_file()):
            target.unlink(missing_ok=True)
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------------------
# Writers never destroy: lock, recover, refuse what is not ours, journal, commit


def check_not_input(output: str | os.PathLike[str], inputs: Iterable[Any], *, name: str = "out_dir") -> None:
    """Refuse an output that resolves (real path, or the same inode) to one of ``inputs``: a file, a
    checkpoint directory (or its manifest) and every file in that directory."""
    real = resolve_output(output)
    for given in inputs:
        if given is None or isinstance(given, Mapping) or not isinstance(given, (str, os.PathLike)):
            continue
        path = Path(given)
        candidates = [path]
        directory = path if path.is_dir() else path.parent if path.name == MANIFEST_NAME else None
        if directory is not None:
            candidates += [directory, *directory.iterdir()]
        for candidate in candidates:
            if resolve_output(candidate) == real or _same_inode(candidate, real):
                raise ValueError(f"{name}: {output} is {candidate}, one of the inputs; write to another path")


def _same_inode(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def begin_write(
    out: str | os.PathLike[str],
    *,
    save_id: str,
    world_size: int,
    purpose: str,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
    staging: str | None = None,
) -> OutputLock:
    """What a writer of a checkpoint directory does before it writes anything; returns the held lock.

    1. Refuse ``out`` if it is one of ``inputs`` (:func:`check_not_input`).
    2. Take ``out``'s lock (:func:`fsdp_optim.locks.lock_output`; a second writer gets ``OutputLockedError``).
    3. Remove what a killed writer of ``out`` left, exactly as its journal announced it (:func:`recover`).
    4. Refuse a directory holding anything but ours (:func:`owned_files`) unless ``overwrite``.
    5. Journal this write: its save id and world size (so its rank files and temporary files are known
       by name), the rank files its commit will replace, its staging directory (beside ``out``).

    Finish with :func:`end_write`, which removes this write's files if it failed.
    """
    check_not_input(out, inputs)
    lock = lock_output(out, purpose=purpose)
    try:
        if lock.previous:
            recover(lock.output, lock.previous)
            lock.forget()
        replaces = owned_files(lock.output, overwrite=overwrite)
        lock.journal(
            {"save_id": save_id, "world_size": world_size, "replaces": sorted(replaces), "staging": staging}
        )
    except BaseException:
        lock.release()
        raise
    return lock


def end_write(lock: OutputLock, *, failed: bool) -> None:
    """Release a lock from :func:`begin_write`; if the write failed, first remove what it created."""
    try:
        if failed:
            recover(lock.output, lock.entries)
    finally:
        lock.release()


def owned_files(directory: Path, *, overwrite: bool = False) -> set[str]:
    """The rank files of the checkpoint in ``directory`` (what a new commit there replaces).

    Ours is ``manifest.pt`` when it reads as an fsdp_optim manifest, and the rank files it lists.
    Anything else (a foreign or unreadable ``manifest.pt``, any other file or directory) is *foreign*:
    refused with :class:`ForeignOutputError` unless ``overwrite``, and never deleted either way.
    Something that exists and is not a directory is refused always.
    """
    if not os.path.lexists(directory):
        return set()
    if not directory.is_dir():
        raise ForeignOutputError(f"{directory}: exists and is not a directory ({describe_file(directory)})")
    names = set(os.listdir(directory))
    files: set[str] = set()
    problem = None
    if MANIFEST_NAME in names:
        try:
            files = {f.file for f in read_manifest(directory).files}
        except (ValueError, OSError) as exc:
            problem = f"its {MANIFEST_NAME} is not an fsdp_optim manifest ({exc})"
    foreign = sorted(names - files - ({MANIFEST_NAME} if problem is None else {MANIFEST_NAME} | files))
    if (foreign or problem) and not overwrite:
        parts = [problem] if problem else []
        if foreign:
            shown = ", ".join(escape(n, limit=80) for n in foreign[:5])
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            parts.append(f"it holds files that are not an fsdp_optim checkpoint's: {shown}{more}")
        raise ForeignOutputError(
            f"{directory}: {'; '.join(parts)}; pass overwrite=True (--overwrite) to write there anyway (nothing "
            "there is deleted)"
        )
    return files if problem is None else set()


def _referenced(directory: Path) -> set[str] | None:
    """Names the checkpoint in ``directory`` uses; empty without a manifest, ``None`` if it is unreadable."""
    if not os.path.lexists(directory / MANIFEST_NAME):
        return set()
    try:
        return {MANIFEST_NAME} | {f.file for f in read_manifest(directory).files}
    except (ValueError, OSError):
        return None


def recover(directory: Path, entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Remove what journal ``entries`` announced and the checkpoint in ``directory`` does not use.

    For a write of save id ``s`` at world size ``W``: its rank files ``optim-<s>-rank*-of-W.pt`` and
    their temporary files, its manifest's temporary file, the files it was to replace (once a newer
    manifest no longer names them) and its staging directory beside ``directory``; for a single file
    written with a tag, that file's temporary files. Rank files are kept while the manifest cannot be
    read (nothing proves them unused). Nothing else is touched.
    """
    referenced = _referenced(directory) if directory.is_dir() else set()
    own: set[str] = set()
    tagged: set[tuple[str, str]] = set()
    replaced: set[str] = set()
    stagings = []
    for entry in entries:
        sid, world_size = entry.get("save_id"), entry.get("world_size")
        if isinstance(sid, str) and _SAVE_ID.match(sid) and isinstance(world_size, int) and 0 < world_size <= MAX_WORLD_SIZE:
            own.update(shard_file_name(sid, r, world_size) for r in range(world_size))
            tagged.add((MANIFEST_NAME, sid[:12]))
            staging = entry.get("staging")
            if isinstance(staging, str) and "/" not in staging and staging.startswith("."):
                stagings.append((directory.parent / staging, sid, world_size))
        if isinstance(entry.get("replaces"), list):
            replaced.update(n for n in entry["replaces"] if isinstance(n, str))
        if isinstance(entry.get("file"), str) and isinstance(entry.get("tag"), str):
            tagged.add((entry["file"], entry["tag"]))
    removed = []
    if directory.is_dir():
        removed += _sweep(directory, own, tagged)
        if referenced is not None:
            removed += remove_stale_files(directory, own | replaced, keep=referenced)
    for staging, sid, world_size in stagings:
        if staging.is_dir() and not staging.is_symlink():
            names = {shard_file_name(sid, r, world_size) for r in range(world_size)}
            removed += _sweep(staging, names, set()) + remove_stale_files(staging, names, keep=set())
            with contextlib.suppress(OSError):  # not empty: something not ours is in there, leave it
                staging.rmdir()
    return removed


def _sweep(directory: Path, own: set[str], tagged: set[tuple[str, str]]) -> list[str]:
    """Delete the temporary files of ``own`` names and of ``(name, tag)`` pairs in ``directory``."""
    removed = []
    for entry in os.scandir(directory):
        plain, with_tag = _TEMP.match(entry.name), _TAGGED_TEMP.match(entry.name)
        ours = (plain is not None and plain["final"] in own) or (
            with_tag is not None and (with_tag["final"], with_tag["tag"]) in tagged
        )
        if ours and not entry.is_dir(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def write_all_or_nothing(
    out: str | os.PathLike[str],
    write: Callable[[Path], Manifest],
    *,
    save_id: str | None = None,
    world_size: int | None = None,
    inputs: Iterable[Any] = (),
    overwrite: bool = False,
) -> Path:
    """Have ``write`` put every rank file into a staging directory beside ``out`` and return the manifest;
    only then move the files into ``out`` and commit the manifest there (last). Holds ``out``'s lock
    throughout (:func:`begin_write`: refused if ``out`` is an input, locked, or foreign without
    ``overwrite``). A refused or failed write leaves ``out`` exactly as it was, or absent, and no
    staging behind; one killed midway is cleaned up by the next writer of ``out`` (given the save id and
    world size the manifest will have, by which its files are journaled)."""
    save_id = save_id or new_save_id()
    name = f".{resolve_output(out).name}.fsdp-optim-staging.{save_id[:12]}"
    lock = begin_write(
        out, save_id=save_id, world_size=world_size or 1, purpose="reshard", inputs=inputs, overwrite=overwrite, staging=name
    )
    target, staging = lock.output, lock.output.parent / name
    failed = True
    try:
        staging.mkdir(mode=0o700)
        manifest = write(staging)
        target.mkdir(exist_ok=True)
        for entry in staging.iterdir():
            os.replace(entry, target / entry.name)
        write_manifest(target, manifest, replaces=lock.entries[-1]["replaces"])
        failed = False
    finally:
        recover(target, [{**lock.entries[-1], "replaces": []}])  # the staging directory, and on failure our files
        end_write(lock, failed=failed)
    return Path(out) / MANIFEST_NAME


def write_file(obj: Any, path: str | os.PathLike[str], *, inputs: Iterable[Any] = ()) -> int:
    """:func:`atomic_save` of a single output file under its lock, refused if it is one of ``inputs``;
    the temporary file is journaled, so one left by a killed writer is removed by the next. Returns
    the file's size. An existing file at ``path`` is replaced (that is what ``-o FILE`` asks for)."""
    check_not_input(path, inputs, name="output")
    tag = uuid.uuid4().hex[:12]
    with lock_output(path, purpose="write a file") as lock:
        if lock.previous:
            recover(lock.output.parent, lock.previous)
            lock.forget()
        lock.journal({"file": lock.output.name, "tag": tag})
        return atomic_save(obj, lock.output, tag=tag)


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if torch.is_tensor(value) else 0


def _declared_bytes(manifest: Manifest) -> int:
    """Bytes of sharded state the manifest says every rank file holds (one shard of each unit, padding
    included; a unit over one rank whole): a file smaller than that was not written from this manifest."""
    total = 0
    for flat in manifest.flat_params:
        shard_numel = -(-flat.numel // flat.world_size)
        for e in flat.state:
            if e.kind is StateKind.SHARDED:
                total += shard_numel * dtype_from_str(e.dtype, where=e.key).itemsize  # type: ignore[arg-type]
    return total


class _RankFile:
    """One rank file, mapped lazily; its header is checked against the manifest on first use."""

    def __init__(self, directory: Path, record: FileRecord, manifest: Manifest) -> None:
        self.path = directory / record.file
        self.record = record
        self.manifest = manifest
        self.payload: Mapping[str, Any] | None = None
        self.verified: set[int] = set()

    def open(self, *, mmap: bool) -> Mapping[str, Any]:
        if self.payload is None:
            # A rank file's name comes from the manifest: it must be a regular file inside the directory.
            payload = load_file(self.path, mmap=mmap, follow_symlinks=False)
            self._check_header(payload)
            # What the manifest's shapes make readers allocate is bounded by what the files really hold
            # (and by what the manifest itself says they hold).
            declared = _declared_bytes(self.manifest)
            check_stored_bytes(str(self.path), declared, self.path.stat().st_size)
            check_stored_bytes(f"{self.path} (as the manifest records it)", declared, self.record.nbytes)
            self.payload = payload
        return self.payload

    def _check_header(self, payload: Any) -> None:
        where = str(self.path)
        head, checksum = read_header(payload, "shard", source=where, covered="unit_checksums", what="fsdp_optim rank file")
        check_tree(payload, where)
        if "state" not in payload:
            raise ValueError(f"{where}: expected an fsdp_optim rank file, found keys {sorted(map(str, payload))}")
        for key in ("state", "unit_checksums"):
            if not isinstance(payload[key], Mapping):
                raise ValueError(f"{where}: '{key}' is a {type(payload[key]).__name__}, expected a dict by flat parameter")
        expected = {
            "save_id": self.manifest.save_id,
            "rank": self.record.rank,
            "world_size": self.manifest.world_size,
        }
        for key, value in expected.items():
            if head.get(key) != value:
                raise ValueError(
                    f"{where}: {key} is {head.get(key)!r}, expected {value!r} from the manifest (a file of another save?)"
                )
        if checksum != self.record.checksum:
            raise ValueError(f"{where}: checksum {checksum} differs from the manifest's {self.record.checksum}")
        check_checksum(head, checksum, payload["unit_checksums"], source=where)

    def unit(self, flat_index: int, *, mmap: bool) -> tuple[Mapping[str, Any], int]:
        """The verified entries of one flat parameter and the bytes they occupy."""
        payload = self.open(mmap=mmap)
        flat = self.manifest.flat_params[flat_index]
        where = f"{self.path}, unit '{flat.unit or '<root>'}' (flat parameter {flat_index})"
        entries = payload["state"].get(flat_index)
        if entries is None or not isinstance(entries, Mapping):
            raise ValueError(f"{where}: no state in the file, but the manifest lists keys {[e.key for e in flat.state]}")
        if flat_index not in self.verified:
            if not digest_matches(entries, payload["unit_checksums"].get(flat_index)):
                raise ValueError(f"{where}: checksum mismatch (file is corrupt or was modified)")
            shard_numel = flat.layout(self.record.rank).shard_numel
            if set(entries) != {e.key for e in flat.state}:
                raise ValueError(f"{where}: state keys {sorted(entries)}, expected {[e.key for e in flat.state]}")
            for e in flat.state:
                value = entries[e.key]
                if e.kind is StateKind.SHARDED:
                    dtype = dtype_from_str(e.dtype, where=where)  # type: ignore[arg-type]
                    if not torch.is_tensor(value) or tuple(value.shape) != (shard_numel,) or value.dtype != dtype:
                        found = f"{tuple(value.shape)} {value.dtype}" if torch.is_tensor(value) else type(value).__name__
                        raise ValueError(f"{where}: state '{e.key}' is {found}, expected ({shard_numel},) {dtype}")
                elif not same_scalar(value, e.value):
                    # Every reader must resume the same way: the manifest's value is what offline tools use.
                    raise ValueError(
                        f"{where}: scalar state '{e.key}' is {show_value(value)}, but the manifest records "
                        f"{show_value(e.value)}"
                    )
            self.verified.add(flat_index)
        return entries, sum(_nbytes(v) for v in entries.values())

    def release(self) -> None:
        self.payload = None


class ShardedCheckpoint:
    """A sharded checkpoint directory opened for reading: its verified manifest and lazy rank files.

    Read one unit at a time with :meth:`unit` (or :meth:`copy_range`), copy what you keep, and call
    :meth:`trim` between units: mapped pages are dropped once they exceed ``max_mapped_bytes``.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_mapped_bytes: int = DEFAULT_MAPPED_BYTES, lazy: bool = False
    ) -> None:
        self.directory = checkpoint_dir(path)
        self.manifest = read_manifest(path)
        if not self.manifest.files:
            raise ValueError(f"{path}: the manifest lists no rank files (a layout file, not a checkpoint)")
        self.max_mapped_bytes = max_mapped_bytes
        self._files = {f.rank: _RankFile(self.directory, f, self.manifest) for f in self.manifest.files}
        self._mapped = 0
        self.peak_mapped = 0
        if not lazy:
            self.open_all()

    def open_all(self) -> None:
        """Map every rank file and check its header and size against the manifest (no unit is read yet).

        Done before anything is planned or allocated, unless ``lazy=True``: the manifest's shapes then
        cannot make a reader allocate more than the rank files really hold. Only a reader that reads
        nothing but its own rank's file (:meth:`load_rank`, a job at the saved layout) opens lazily.
        """
        for f in self._files.values():
            f.open(mmap=True)

    def source(self) -> Source:
        """This checkpoint as a planning source (reads go through :meth:`copy_range`)."""
        rank_reader = self.reader if any(f.per_rank for f in self.manifest.flat_params) else None
        return Source.of_manifest(self.manifest, str(self.directory), self.copy_range, self.load_rank, rank_reader)

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.release()
        self._mapped = 0

    def unit(self, rank: int, flat_index: int) -> Mapping[str, Any]:
        """Rank ``rank``'s verified entries for flat parameter ``flat_index`` (file-backed: copy what you keep)."""
        entries, nbytes = self._files[self._file_rank(rank, flat_index)].unit(flat_index, mmap=True)
        self._mapped += nbytes
        self.peak_mapped = max(self.peak_mapped, self._mapped)
        return entries

    def _file_rank(self, rank: int, flat_index: int) -> int:
        # A unit that is not sharded is stored whole in every rank file; read rank 0's, unless every
        # rank holds its own copy (per-rank units, MoE experts).
        flat = self.manifest.flat_params[flat_index]
        return rank if flat.world_size > 1 or flat.per_rank else 0

    def load_rank(self, rank: int) -> dict[int, dict[str, Any]]:
        """Every unit of one rank file, read into memory (not mapped) and verified."""
        f = self._files[rank]
        if f.payload is not None:  # mapped by open_all(): read the file again, into memory
            f.release()
            f.verified.clear()
        try:
            out = {}
            for i, flat in enumerate(self.manifest.flat_params):
                if flat.state:
                    entries, _ = f.unit(i, mmap=False)
                    out[i] = dict(entries)
            return out
        finally:
            f.release()

    def reader(self, rank: int) -> Callable[[int, str, int, int, torch.Tensor], None]:
        """:meth:`copy_range`, except that per-rank units are read from rank ``rank``'s own file."""

        def read(flat_index: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
            if self.manifest.flat_params[flat_index].per_rank:
                out.copy_(self.unit(rank, flat_index)[key][start:stop])
            else:
                self.copy_range(flat_index, key, start, stop, out)

        return read

    def copy_range(self, flat_index: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of flat parameter ``flat_index``'s full state ``key`` into ``out``."""
        flat = self.manifest.flat_params[flat_index]
        for rank in range(flat.world_size):
            bounds = flat.layout(rank).bounds()
            lo, hi = max(start, bounds.start), min(stop, bounds.stop)
            if lo < hi:
                shard = self.unit(rank, flat_index)[key]
                out[lo - start : hi - start].copy_(shard[lo - bounds.start : hi - bounds.start])

    def trim(self) -> None:
        """Drop the file mappings if the pages touched since the last drop exceed ``max_mapped_bytes``."""
        if self._mapped > self.max_mapped_bytes:
            self.close()

    def files(self) -> Iterator[Path]:
        return (self.directory / f.file for f in self.manifest.files)
