"""What a ``torch.save`` file may hold, checked on its bytes before anything is unpickled: zip records stored
uncompressed, inside the file and disjoint; a pickle naming only the globals optimizer state needs (real dtypes,
dense tensors, ``OrderedDict``), scanned opcode by opcode, with storage sizes that match their records.
"""

from __future__ import annotations

import os
import pickletools
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fsdp_optim.core.dtypes import ALLOWED_DTYPES
from fsdp_optim.core.limits import MAX_RECORDS
from fsdp_optim.disk.text import escape, unreadable


@dataclass(frozen=True)
class _Record:
    name: str
    offset: int  # of its data
    size: int



def zip_records(fd: int, size: int, where: str) -> list[_Record]:
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



_ITEMSIZE = {"FloatStorage": 4, "DoubleStorage": 8, "HalfStorage": 2, "BFloat16Storage": 2, "ByteStorage": 1,
             "CharStorage": 1, "ShortStorage": 2, "IntStorage": 4, "LongStorage": 8, "BoolStorage": 1,
             "UntypedStorage": 1}  # fmt: skip
# Globals a torch.save file of optimizer state names: dense tensors of real dtypes and OrderedDict.
_REAL_STORAGES = _ITEMSIZE.keys() - {"UntypedStorage"}
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



_UNKNOWN = object()



_PUSH_VALUE = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BININT", "BININT1", "BININT2",
               "LONG1", "LONG4", "INT", "LONG"}  # fmt: skip



def scan_pickle(data: bytes, where: str) -> dict[str, int]:
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
