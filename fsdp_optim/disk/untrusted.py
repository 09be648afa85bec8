"""The gate for what fsdp_optim does not trust: file contents and the objects they (or callers) hand over.

Pure: no ``torch.distributed``; opens files only to read them. Every reader goes through here before it
allocates anything whose size a file (or a dict) merely *declares*:

- :func:`load_untrusted` (what ``storage.load_file`` does): the path is a regular file (never a FIFO,
  device, socket or directory; a rank file never a symlink); its size is what the manifest recorded;
  its zip records are stored uncompressed, lie inside the file and do not overlap (so storages cost at
  most the file's own bytes); its pickle names only the globals an optimizer checkpoint needs (real
  dtypes, dense tensors, ``OrderedDict``), scanned opcode by opcode before anything is unpickled; then
  ``torch.load(weights_only=True)`` and :func:`check_tree` on what it returned.
- :func:`check_tree`: one walk, memoized by identity (a shared object is visited once, but counted once
  per reference, so a structure whose expansion is exponential is refused in linear time), iterative
  (no recursion), refusing cycles, nesting deeper than :data:`MAX_DEPTH` and more than :data:`MAX_NODES`
  references; then :func:`check_tensor` on every tensor: strided, dense and non-overlapping, inside its
  storage, of an allowed dtype (:data:`ALLOWED_DTYPES`), not quantized/sparse/meta/nested/a subclass;
  and no two multi-element tensors share memory (nor is one referenced twice).
- :func:`check_state_dict`: the above plus the types a state dict's skeleton must have (ids, keys,
  param groups), so a mistyped dict is refused naming where, instead of failing deep inside.
- :func:`check_world_size_bound`, :func:`check_stored_bytes`: declared world sizes and state bytes
  against :data:`MAX_WORLD_SIZE` and the files' real sizes.

Every refusal is a ``ValueError`` naming the file or dict, the place
inside it and what was expected and found; a file torch cannot parse at all is a ``ValueError`` saying
it "cannot be read with torch.load(weights_only=True)". :func:`escape` makes untrusted text safe to print.
"""

from __future__ import annotations

import os
import pickletools
import stat
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_optim.core.dtypes import ALLOWED_DTYPES
from fsdp_optim.core.limits import MAX_DEPTH, MAX_NODES, MAX_RECORDS

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_RECORDS",
    "check_state_dict",
    "check_stored_bytes",
    "check_tensor",
    "check_tree",
    "describe_file",
    "escape",
    "load_untrusted",
    "open_regular",
]


def unreadable(where: Any, reason: str) -> ValueError:
    return ValueError(f"{where}: cannot be read with torch.load(weights_only=True): {reason}")


# ---------------------------------------------------------------------------------------------------
# Printing untrusted text


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str, *, limit: int = 4096) -> str:
    """``text`` with control characters (C0, DEL, C1, bidirectional overrides) shown as escapes, so a
    parameter name cannot move the cursor, recolour or rewrite a terminal; cut to ``limit`` characters."""
    out = []
    for ch in text[:limit]:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif 0x202A <= code <= 0x202E or 0x2066 <= code <= 0x2069 or code in (0x200E, 0x200F, 0x061C):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out) + (f"... ({len(text) - limit} more characters)" if len(text) > limit else "")


# ---------------------------------------------------------------------------------------------------
# Files


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> tuple[int, os.stat_result]:
    """An open descriptor of ``path`` and its ``fstat``, refusing anything but a regular file.

    Opened non-blocking (a FIFO cannot hang the caller) and, with ``follow_symlinks=False``, without
    following a final symlink. Raises ``FileNotFoundError`` for nothing there and
    ``ValueError`` for the wrong kind of file.
    """
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


@dataclass(frozen=True)
class _Record:
    name: str
    offset: int  # of its data
    size: int


def _zip_records(fd: int, size: int, where: str) -> list[_Record]:
    """The records of a ``torch.save`` zip file, each checked to be stored, inside the file and disjoint."""
    with open(fd, "rb", closefd=False) as f:
        try:
            with zipfile.ZipFile(f) as z:
                infos = z.infolist()
        except Exception as exc:  # noqa: BLE001 - zipfile raises many kinds on garbage
            raise unreadable(
                where,
                f"not a zip file: truncated, or not the format torch.save writes since torch 1.6 "
                f"({type(exc).__name__}: {exc})",
            ) from None
    if len(infos) > MAX_RECORDS:
        raise ValueError(f"{where}: holds {len(infos)} zip records, more than the bound {MAX_RECORDS}")
    records = []
    for info in infos:
        name = escape(info.filename, limit=200)
        if info.flag_bits & 0x1:
            raise ValueError(f"{where}: zip record '{name}' is encrypted")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise ValueError(
                f"{where}: zip record '{name}' is compressed (method {info.compress_type}, {info.compress_size} bytes "
                f"declaring {info.file_size}); torch.save stores records uncompressed, and a compressed one could "
                "inflate"
            )
        header = os.pread(fd, 30, info.header_offset)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise unreadable(where, f"zip record '{name}' has no local header at offset {info.header_offset}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = info.header_offset + 30 + name_len + extra_len
        if offset + info.file_size > size:
            raise ValueError(
                f"{where}: zip record '{name}' declares {info.file_size} bytes at offset {offset}, past the end of "
                f"the {size}-byte file"
            )
        records.append(_Record(info.filename, offset, info.file_size))
    records.sort(key=lambda r: r.offset)
    for a, b in zip(records, records[1:]):
        if a.offset + a.size > b.offset:
            raise ValueError(
                f"{where}: zip records '{escape(a.name, limit=200)}' and '{escape(b.name, limit=200)}' overlap "
                "(one file's bytes counted twice)"
            )
    return records


# Globals a torch.save file of optimizer state names: dense tensors of real dtypes and OrderedDict.
_REAL_STORAGES = {"FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage", "ByteStorage", "CharStorage",
                  "ShortStorage", "IntStorage", "LongStorage", "BoolStorage"}  # fmt: skip
_ALLOWED_GLOBALS = (
    {("collections", "OrderedDict"), ("torch", "Size"), ("torch.storage", "UntypedStorage"), ("torch", "Tensor")}
    | {("torch._tensor", "_rebuild_from_type_v2")}  # a tensor with Python attributes (a model's state_dict)
    | {
        ("torch._utils", f)
        for f in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter")
    }
    | {("torch", s) for s in _REAL_STORAGES}
    | {("torch", str(d).removeprefix("torch.")) for d in ALLOWED_DTYPES}
)
_REFUSED_GLOBALS = {
    "_rebuild_qtensor": "a quantized tensor",
    "_rebuild_sparse_tensor": "a sparse tensor",
    "_get_layout": "a sparse tensor",
    "_rebuild_meta_tensor_no_storage": "a meta tensor (a shape without data)",
    "_rebuild_nested_tensor": "a nested tensor",
    "_rebuild_wrapper_subclass": "a tensor subclass",
    "_rebuild_device_tensor_from_numpy": "a tensor rebuilt from numpy",
    "_rebuild_device_tensor_from_cpu_tensor": "a tensor converted on load",
    "_rebuild_parameter_with_state": "a parameter with Python state",
    "bytearray": "a bytearray (its size is an argument: it could allocate anything)",
    "complex": "a complex number",
}


def _refused_global(module: str, name: str) -> str:
    if name in _REFUSED_GLOBALS:
        return _REFUSED_GLOBALS[name]
    if name.startswith(("Q", "qu", "qi")) or "quint" in name or "qint" in name:
        return "a quantized tensor"
    if "omplex" in name:
        return "a complex tensor"
    if module.startswith("torch.sparse") or module.startswith("torch.cuda.sparse"):
        return "a sparse tensor"
    return "an object that optimizer state does not hold"


def _opcodes(data: bytes, where: str) -> Iterator[tuple[Any, Any]]:
    ops = pickletools.genops(data)
    while True:
        try:
            op, arg, _ = next(ops)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - a torn pickle: genops raises ValueError and friends
            raise unreadable(where, f"its pickle is malformed ({type(exc).__name__}: {exc})") from None
        yield op, arg


_ITEMSIZE = {"FloatStorage": 4, "DoubleStorage": 8, "HalfStorage": 2, "BFloat16Storage": 2, "ByteStorage": 1,
             "CharStorage": 1, "ShortStorage": 2, "IntStorage": 4, "LongStorage": 8, "BoolStorage": 1,
             "UntypedStorage": 1}  # fmt: skip
_UNKNOWN = object()
_PUSH_VALUE = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BININT", "BININT1", "BININT2",
               "LONG1", "LONG4", "INT", "LONG"}  # fmt: skip


def _scan_pickle(data: bytes, where: str) -> dict[str, int]:
    """Refuse a pickle that names a global outside :data:`_ALLOWED_GLOBALS` or holds an integer of more
    than 64 bits, before anything is unpickled; return the bytes each storage record must hold, as the
    pickle declares them (``{key: nbytes}``).

    Persistent ids are read the way ``torch.save`` writes them (``MARK 'storage' GLOBAL key location
    numel TUPLE BINPERSID``, strings possibly memoized); one that cannot be read so is refused.
    """
    frames: list[list[Any]] = []  # values pushed since each open MARK (simple values, else _UNKNOWN)
    memo: dict[Any, Any] = {}
    last: Any = _UNKNOWN  # the value most recently pushed (what BINPUT memoizes)
    storages: dict[str, int] = {}
    for op, arg in _opcodes(data, where):
        name, value = op.name, _UNKNOWN
        if name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            if (module, attr) not in _ALLOWED_GLOBALS:
                raise ValueError(
                    f"{where}: holds {_refused_global(module, attr)} ({escape(module, limit=80)}."
                    f"{escape(attr, limit=80)}), which fsdp_optim does not read"
                )
            value = ("global", attr)
        elif name in ("STACK_GLOBAL", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID"):
            raise ValueError(f"{where}: its pickle uses {name}, which torch.save does not write")
        elif name in _PUSH_VALUE:
            if isinstance(arg, int) and not -(1 << 63) <= arg < (1 << 64):
                raise ValueError(f"{where}: holds an integer of {arg.bit_length()} bits")
            value = arg
        if name == "MARK":
            frames.append([])
            continue
        if name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = last
            continue
        if name == "MEMOIZE":
            memo[len(memo)] = last
            continue
        if name in ("BINGET", "LONG_BINGET", "GET"):
            value = memo.get(arg, _UNKNOWN)
        elif name == "TUPLE" and frames:
            value = tuple(frames.pop())
        elif name == "BINPERSID":
            _storage_of(last, storages, where)
        if frames:
            frames[-1].append(value)
        last = value
    return storages


def _storage_of(pid: Any, storages: dict[str, int], where: str) -> None:
    """Record what a ``torch.save`` persistent id ``('storage', type, key, location, numel)`` declares."""
    if (
        not isinstance(pid, tuple)
        or len(pid) != 5
        or pid[0] != "storage"
        or not (isinstance(pid[1], tuple) and pid[1][1] in _ITEMSIZE)
        or not isinstance(pid[2], str)
        or not isinstance(pid[4], int)
        or pid[4] < 0
    ):
        raise ValueError(
            f"{where}: a storage reference that is not in torch.save's form ({escape(repr(pid), limit=200)})"
        )
    storages[pid[2]] = pid[4] * _ITEMSIZE[pid[1][1]]


def load_untrusted(
    path: str | os.PathLike[str], *, mmap: bool = False, follow_symlinks: bool = True, disjoint: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, after the file checks in the module docstring
    and before returning, :func:`check_tree` on the result (``disjoint=False`` by default: a caller that
    knows the file holds optimizer state passes ``True``); no returned tensor requires grad.

    The file is opened once: the checks and the load read the same file even if the
    path is renamed meanwhile (on Linux, where ``/proc/self/fd`` exists, for ``mmap`` too).
    """
    where = str(path)
    fd, st = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        records = _zip_records(fd, st.st_size, where)
        pickles = [r for r in records if r.name.endswith("/data.pkl") and r.name.count("/") == 1]
        if len(pickles) != 1:
            raise unreadable(where, f"expected one data.pkl record in the zip file, found {len(pickles)}")
        declared = _scan_pickle(os.pread(fd, pickles[0].size, pickles[0].offset), where)
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
    for t in check_tree(obj, where, disjoint=disjoint):
        if t.requires_grad:  # a file holds values, never autograd state (leaves: this is allowed)
            t.requires_grad_(False)
    return obj


def _reason(exc: BaseException) -> str:
    """One line saying why torch could not load a file (past torch's weights_only boilerplate)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    marker = next((i for i, line in enumerate(lines) if "WeightsUnpickler error" in line), None)
    if marker is not None:
        rest = lines[marker].split("WeightsUnpickler error:", 1)[1].strip()
        lines = ([rest] if rest else []) + lines[marker + 1 :]
    return escape(lines[0], limit=300) if lines else type(exc).__name__


def check_stored_bytes(where: str, declared: int, actual: int) -> None:
    """Refuse a file that is to hold ``declared`` bytes of state but has only ``actual`` bytes."""
    if declared > actual:
        raise ValueError(
            f"{where}: the manifest declares {declared} bytes of state for it, but it has {actual} bytes"
        )


# ---------------------------------------------------------------------------------------------------
# Objects


def _show_path(where: str, path: tuple[Any, ...]) -> str:
    return where + "".join(f"[{escape(repr(k), limit=60)}]" for k in path)


_CONTAINERS = frozenset({dict, list, tuple})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_LEAVES = frozenset({int, float, str, bool, type(None), torch.Tensor, torch.nn.Parameter})


@dataclass
class _Tensor:
    tensor: torch.Tensor
    path: tuple[Any, ...]
    references: int = 1


def check_tree(
    obj: Any,
    where: str,
    *,
    disjoint: bool = True,
    in_memory: bool = False,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
) -> list[torch.Tensor]:
    """Walk ``obj`` once (see the module docstring) and check every tensor; return the distinct tensors.
    Raises ``ValueError`` naming the place.

    ``disjoint``: also refuse multi-element tensors that share memory. Views of one buffer that overlap
    would let a small file stand for many times its size (every view read or copied in turn); readers
    check it once they know the file is theirs (a model's ``state_dict`` with tied weights is not).

    ``in_memory``: ``obj`` is what a caller holds, not what a file declares. Views (transposed, strided,
    expanded) and tensors shared or referenced twice cost nothing to read and are accepted (readers copy
    where needed); only each tensor's kind is checked (dtype, layout, not meta, not a subclass).
    """
    tensors = _Walk(where, max_depth, max_nodes).run(obj)
    for seen in tensors.values():  # where a tensor is, is spelled out only for an error
        problem = _kind_problem(seen.tensor) if in_memory else _tensor_problem(seen.tensor)
        if problem is None and not in_memory and seen.references > 1 and seen.tensor.numel() > 1:
            problem = f"one tensor of {seen.tensor.numel()} elements referenced {seen.references} times"
        if problem is not None:
            raise ValueError(f"{_show_path(where, seen.path)}: {problem}")
    if disjoint and not in_memory:
        _check_disjoint(list(tensors.values()), where)
    return [seen.tensor for seen in tensors.values()]


class _Walk:
    """One iterative, memoized, bounded walk of a loaded object (no recursion: depth is data here)."""

    def __init__(self, where: str, max_depth: int, max_nodes: int) -> None:
        self.where, self.max_depth, self.max_nodes = where, max_depth, max_nodes
        self.sizes: dict[int, int] = {}  # id -> references under it (itself included), for finished containers
        self.tensors: dict[int, _Tensor] = {}
        self.open_ids: set[int] = set()
        self.total = 0
        # Frames: [container, its path, iterator over (key, child), references so far]
        self.stack: list[list[Any]] = []

    def run(self, obj: Any) -> dict[int, _Tensor]:
        if self.visit(obj, ()) is None:
            self.enter(obj, ())
            self.add(1)
        while self.stack:
            frame = self.stack[-1]
            node, path, items, _ = frame
            step = next(items, None)
            if step is None:
                self.stack.pop()
                self.open_ids.discard(id(node))
                self.sizes[id(node)] = frame[3]
                if self.stack:
                    self.stack[-1][3] += frame[3]
                continue
            key, child = step
            if isinstance(node, Mapping) and self.visit(key, (*path, key)) is None:
                raise ValueError(f"{_show_path(self.where, path)}: has a container as a key")
            counted = self.visit(child, (*path, key))
            if counted is None:
                self.add(1)
                self.enter(child, (*path, key))
            else:
                self.add(counted)  # a shared container counts all its references again, without a second walk
                frame[3] += counted
        return self.tensors

    def visit(self, node: Any, path: tuple[Any, ...]) -> int | None:
        """Count a leaf or a memoized container; ``None`` for a container to descend into."""
        kind = type(node)
        if kind in _CONTAINERS or (kind not in _LEAVES and isinstance(node, (Mapping, list, tuple, set, frozenset))):
            key = id(node)
            if key in self.open_ids:
                raise ValueError(f"{_show_path(self.where, path)}: a container that contains itself (a cycle)")
            if key in self.sizes:
                return self.sizes[key]
            if len(path) >= self.max_depth:
                raise ValueError(f"{_show_path(self.where, path)}: nested deeper than {self.max_depth} levels")
            return None
        if kind in _LEAVES and kind not in _TENSORS:
            if kind is int and not -(1 << 63) <= node < (1 << 64):
                raise ValueError(f"{_show_path(self.where, path)}: an integer of {node.bit_length()} bits")
            return 1
        if torch.is_tensor(node):
            seen = self.tensors.get(id(node))
            if seen is None:
                self.tensors[id(node)] = _Tensor(node, path)
            else:
                seen.references += 1
        elif isinstance(node, int) and not isinstance(node, bool) and not -(1 << 63) <= node < (1 << 64):
            raise ValueError(f"{_show_path(self.where, path)}: an integer of {node.bit_length()} bits")
        return 1

    def enter(self, node: Any, path: tuple[Any, ...]) -> None:
        self.open_ids.add(id(node))
        if isinstance(node, Mapping):
            items: Iterator[tuple[Any, Any]] = ((k, v) for k, v in node.items())
        elif isinstance(node, (set, frozenset)):
            items = ((None, v) for v in node)
        else:
            items = enumerate(node)
        self.stack.append([node, path, items, 1])

    def add(self, count: int) -> None:
        self.total += count
        if self.total > self.max_nodes:
            raise ValueError(
                f"{self.where}: holds more than {self.max_nodes} objects counting every reference (shared objects "
                "once per reference); the bound is fsdp_optim.untrusted.MAX_NODES"
            )


def check_tensor(t: torch.Tensor, where: str) -> None:
    """Refuse a tensor that is not a dense, non-overlapping, strided CPU/accelerator tensor of an allowed
    dtype lying inside its storage (see the module docstring)."""
    problem = _tensor_problem(t)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")


def _tensor_problem(t: torch.Tensor) -> str | None:
    return _kind_problem(t) or _layout_problem(t)


def _kind_problem(t: torch.Tensor) -> str | None:
    if type(t) not in _TENSORS:
        return f"a tensor subclass ({type(t).__name__}), expected a plain tensor"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}), expected a plain tensor of real numbers"
    if t.layout is not torch.strided:
        return f"a sparse tensor (layout {t.layout}), expected a dense (strided) tensor"
    if t.is_nested:
        return "a nested tensor, expected a dense tensor"
    if t.is_meta:
        return f"a meta tensor (a shape {tuple(t.shape)} without data)"
    if t.dtype not in ALLOWED_DTYPES:
        kind = "complex" if t.dtype.is_complex else "unsupported"
        return f"a {kind} tensor ({t.dtype}); optimizer state here is real numbers"
    return None


def _layout_problem(t: torch.Tensor) -> str | None:
    numel = t.numel()
    if numel <= 1:
        return None if numel == 0 or t.storage_offset() * t.element_size() < t.untyped_storage().nbytes() else (
            f"its element at offset {t.storage_offset()} lies outside its storage"
        )
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride != expected:
            return (
                f"declares shape {tuple(t.shape)} with strides {tuple(t.stride())} over "
                f"{t.untyped_storage().nbytes()} bytes of storage; expected a dense, non-overlapping tensor "
                f"({'a zero stride repeats elements' if stride == 0 else 'its elements overlap or leave gaps'})"
            )
        expected *= size
    nbytes = t.untyped_storage().nbytes()
    if (t.storage_offset() + numel) * t.element_size() > nbytes:
        return f"{numel} elements at offset {t.storage_offset()} lie outside its storage of {nbytes} bytes"
    return None


def _check_disjoint(tensors: list[_Tensor], where: str) -> None:
    """Refuse two multi-element tensors sharing memory (views of one buffer must not overlap)."""
    spans: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for n, seen in enumerate(tensors):
        t = seen.tensor
        if t.numel() > 1:
            start = int(t.storage_offset()) * t.element_size()
            key = (str(t.device), t.untyped_storage().data_ptr())
            spans.setdefault(key, []).append((start, start + int(t.numel()) * t.element_size(), n))
    for runs in spans.values():
        runs.sort()
        for (_, stop, a), (start, _, b) in zip(runs, runs[1:]):
            if start < stop:
                raise ValueError(
                    f"{_show_path(where, tensors[b].path)}: shares memory with {_show_path(where, tensors[a].path)}; "
                    "tensors of optimizer state must not overlap"
                )


def check_state_dict(obj: Any, where: str, *, in_memory: bool = False) -> None:
    """:func:`check_tree` plus the skeleton of an optimizer state dict (ours, a plain optimizer's or
    fairscale's), for the keys present: ``state`` maps ids (ints or strings) to dicts keyed by strings,
    ``param_groups`` is a list of dicts keyed by strings whose ``params`` lists ids, ``param_names`` and
    ``param_id_map`` map ids, ``uncollected_local_ids`` is a list. What the values mean is the engine's job.
    ``in_memory``: a dict the caller holds (see :func:`check_tree`); a file's went through the gate already."""
    check_tree(obj, where, in_memory=in_memory)
    if not isinstance(obj, Mapping):
        return
    for key, kind in (("state", Mapping), ("param_groups", (list, tuple)), ("param_names", Mapping),
                      ("param_id_map", Mapping), ("uncollected_local_ids", (list, tuple))):  # fmt: skip
        if key in obj and not isinstance(obj[key], kind):
            expected = "a dict" if kind is Mapping else "a list"
            raise ValueError(f"{where}['{key}']: a {type(obj[key]).__name__}, expected {expected}")
    for pid, entries in obj.get("state", {}).items():
        _check_id(pid, f"{where}['state']")
        if not isinstance(entries, Mapping) or not all(type(key) is str for key in entries):
            here = f"{where}['state'][{escape(repr(pid), limit=60)}]"
            if not isinstance(entries, Mapping):
                raise ValueError(f"{here}: a {type(entries).__name__}, expected a dict of state keys")
            _check_keys(entries, here)
    for key in ("param_names", "param_id_map"):
        for pid in obj.get(key, {}):
            _check_id(pid, f"{where}['{key}']")
    for k, group in enumerate(obj.get("param_groups", ())):
        here = f"{where}['param_groups'][{k}]"
        if not isinstance(group, Mapping):
            raise ValueError(f"{here}: a {type(group).__name__}, expected a dict")
        _check_keys(group, here)
        params = group.get("params")
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"{here}['params']: a {type(params).__name__}, expected a list of ids")
        for pid in params:
            _check_id(pid, f"{here}['params']")


def _check_id(pid: Any, where: str) -> None:
    if type(pid) is not int and (not isinstance(pid, (int, str)) or isinstance(pid, bool)):
        raise ValueError(
            f"{where}: parameter id {escape(repr(pid), limit=80)} is a {type(pid).__name__}, expected an int"
        )


def _check_keys(d: Mapping[Any, Any], where: str) -> None:
    for key in d:
        if not isinstance(key, str):
            raise ValueError(f"{where}: key {escape(repr(key), limit=80)} is a {type(key).__name__}, expected a string")


def describe_file(path: str | os.PathLike[str]) -> str:
    """What is at ``path`` (for messages): 'a directory', 'a FIFO (named pipe)', ... or 'nothing'."""
    kind = _kind_of(path)
    return "nothing" if kind is None and not os.path.lexists(path) else (kind or "a regular file")

