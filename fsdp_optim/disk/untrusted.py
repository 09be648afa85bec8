"""The gate for what fsdp_optim does not trust: file contents and the objects they (or callers) hand over.

Pure: no ``torch.distributed``; opens files only to read them. Every reader goes through here before it allocates
anything whose size a file (or a dict) merely *declares*:

- :func:`load_file`: a regular file (never a FIFO, device, socket or directory; a rank file never a symlink); zip
  records stored uncompressed, inside the file and disjoint (storages cost at most the file's own bytes); a pickle
  naming only the globals optimizer state needs, scanned opcode by opcode before anything is unpickled
  (``disk/torch_file.py``); then ``torch.load(weights_only=True)`` and ``check_tree`` on what it returned.
- ``check_tree`` and ``check_state_dict`` (``disk/objects.py``): one bounded walk (a structure whose expansion is
  exponential is refused in linear time) checking every tensor, and a state dict's skeleton typed.
- :func:`~fsdp_optim.core.limits.check_world_size_bound`, :func:`check_stored_bytes`: declared world sizes and
  state bytes against :data:`~fsdp_optim.core.limits.MAX_WORLD_SIZE` and the files' real sizes.

Every refusal is a ``ValueError`` naming the file or dict, the place inside it and what was expected and found; a
file torch cannot parse at all "cannot be read with torch.load(weights_only=True)".
"""

from __future__ import annotations

import os
import pickle
import stat
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from fsdp_optim.disk.objects import check_tree
from fsdp_optim.disk.text import escape, unreadable
from fsdp_optim.disk.torch_file import scan_pickle, zip_records

__all__ = [
    "check_stored_bytes",
    "describe_file",
    "load_foreign",
    "load_file",
    "open_regular",
]

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> tuple[int, os.stat_result]:
    """An open descriptor of ``path`` and its ``fstat``, refusing anything but a regular file (``ValueError``).
    Opened non-blocking (a FIFO cannot hang the caller); ``follow_symlinks=False``: not through a final symlink."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        kind = _kind_of(path)
        if kind is not None:
            raise ValueError(f"{path}: is {kind}, expected a regular file") from None
        raise OSError(exc.errno, f"{path}: cannot open it: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(
            f"{path}: is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, expected a regular file"
        )
    return fd, st


def _kind_of(path: str | os.PathLike[str]) -> str | None:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def load_file(
    path: str | os.PathLike[str], *, mmap: bool = False, follow_symlinks: bool = True, disjoint: bool = False,
    tied: str | None = None, shared: bool = False,
) -> Any:  # fmt: skip
    """``torch.load(path, weights_only=True)`` on the CPU, after the file checks in the module docstring and before
    returning, :func:`check_tree` on the result; no returned tensor requires grad. The file is opened once: the
    checks and the load read the same file even if the path is renamed meanwhile (for ``mmap`` too, on Linux).

    ``FileNotFoundError`` for nothing there; ``ValueError`` naming the file for content that cannot be read, a file
    that is not a regular file (a symlink where ``follow_symlinks=False``), exceeds a bound or holds what optimizer
    state does not. ``disjoint=True`` for a file that must hold an optimizer state dict: two of its tensors sharing
    memory are refused too; ``tied``, ``shared``: see :func:`~fsdp_optim.disk.objects.check_tree`."""
    where = str(path)
    fd, st = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        records = zip_records(fd, st.st_size, where)
        pickles = [r for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1]
        if len(pickles) != 1:
            raise unreadable(where, f"expected one data.pkl record in the zip file, found {len(pickles)}")
        declared = scan_pickle(os.pread(fd, pickles[0].size, pickles[0].offset), where)
        folder = pickles[0].name.rsplit("/", 1)[0]
        sizes = {r.name: r.size for r in records}
        for key, nbytes in declared.items():
            found = sizes.get(f"{folder}/data/{key}")
            if found != nbytes:  # torch.load would slice past the record (mmap) or allocate first
                raise ValueError(
                    f"{where}: storage '{escape(key, limit=80)}' declares {nbytes} bytes, but its record holds "
                    f"{'none' if found is None else found}"
                )
        try:
            if mmap:
                proc = f"/proc/self/fd/{fd}"
                where_from = proc if os.path.exists(proc) else path
                obj = torch.load(where_from, map_location="cpu", weights_only=True, mmap=True)
            else:
                os.lseek(fd, 0, os.SEEK_SET)
                with open(fd, "rb", closefd=False) as f:
                    obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a torn or foreign file: pickle, zip and weights_only errors alike
            raise unreadable(where, _reason(exc)) from None
    finally:
        os.close(fd)
    for t in check_tree(obj, where, disjoint=disjoint, tied=tied, shared=shared):
        if t.requires_grad:  # a file holds values, never autograd state (leaves: this is allowed)
            t.requires_grad_(False)
    return obj


def load_foreign(path: str | os.PathLike[str], *, allowed_globals: Sequence[Any] = (), mmap: bool = True) -> Any:
    """A torch file another program wrote (fairseq/metaseq shards): ``torch.load(weights_only=True)`` on the CPU
    with ``allowed_globals`` (data-only classes the caller names) allowed, memory-mapped if ``mmap`` and the file is
    a zip. The file is opened once, as a regular file. Its pickle is not scanned against the optimizer-state globals
    (such files hold configs); ``weights_only`` refuses every other class, and the refusal names all of them."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    fd, _ = open_regular(path)
    try:
        proc = f"/proc/self/fd/{fd}"
        source: str | os.PathLike[str] = proc if os.path.exists(proc) else path
        zipped = zipfile.is_zipfile(source)
        with torch.serialization.safe_globals(list(allowed_globals)):
            try:
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and zipped)
            except pickle.UnpicklingError as exc:
                unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source)) if zipped else []
                if unsafe:
                    raise ValueError(
                        f"{path}: holds objects of {', '.join(unsafe)}, which weights_only loading refuses "
                        "(fsdp_optim never runs code from a checkpoint file); if you trust the file, allow them "
                        f"with allow_globals={unsafe!r} (CLI: --allow-global NAME)"
                    ) from exc
                raise unreadable(str(path), _first_line(exc)) from exc
            except Exception as exc:  # noqa: BLE001 - a torn or foreign file: zip and pickle errors alike
                raise unreadable(str(path), _first_line(exc)) from exc
    finally:
        os.close(fd)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _reason(exc: BaseException) -> str:
    """One line saying why torch could not load a file (past torch's weights_only boilerplate)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    marker = next((i for i, line in enumerate(lines) if "WeightsUnpickler error" in line), None)
    if marker is not None:
        rest = lines[marker].split("WeightsUnpickler error:", 1)[1].strip()
        lines = ([rest] if rest else []) + lines[marker + 1 :]
    return escape(lines[0], limit=300) if lines else type(exc).__name__


def check_stored_bytes(where: str, declared: int, actual: int) -> None:
    if declared > actual:
        raise ValueError(
            f"{where}: the manifest declares {declared} bytes of state for it, but it has {actual} bytes"
        )


def describe_file(path: str | os.PathLike[str]) -> str:
    """What is at ``path`` (for messages): 'a directory', 'a FIFO (named pipe)', ... or 'nothing'."""
    kind = _kind_of(path)
    return "nothing" if kind is None and not os.path.lexists(path) else (kind or "a regular file")

