"""A whole checkpoint's side files: one per rank, holding that rank's ``extra`` and (rank 0, or every rank when
they differ) the model's buffers. A safetensors file, read whole and checked against the manifest's digest of its
bytes before any of it is parsed (side files are small: loop state and buffers, not weights)::

    <u64 n> {"__metadata__": {"format": "fsdp_optim", "kind": "side", "version": "1", "save_id": "3f2a...",
                              "rank": "0", "world_size": "2",
                              "extra": "{\\"step\\": 100, \\"rng\\": {\\"$extra\\": 0}, ...}"},  # JSON in a string
             "buffers/norm.running_mean": {...}, "extra/0": {"dtype": "U8", "shape": [5056], ...}}  <data>

``extra`` is any tree of dicts (``str`` keys), lists, tuples, JSON scalars and tensors: tensors become
``{"$extra": k}`` in the JSON and tensor ``extra/<k>`` in the file; the rest is the manifest's exact JSON
(:mod:`.json_values`: tuples, non-finite floats and ``$``-keys tagged), so every value comes back with its type.
Nesting is bounded by :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.disk.atomic import atomic_write
from fsdp_optim.disk.json_input import loads
from fsdp_optim.disk.storage import ObjectStore, Where
from fsdp_optim.disk.untrusted import open_regular
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.json_values import from_json, to_json
from fsdp_optim.formats.sharded.training import TrainingRecord, side_file_name

__all__ = [
    "MAX_DEPTH", "SideContent", "decode_extra", "encode_extra", "read_rank_side", "read_side_file", "write_side_file"
]

MAX_DEPTH = 64  # levels of nesting in ``extra``
_REF = "$extra"
_BUFFER, _EXTRA = "buffers/", "extra/"
SideContent = tuple[dict[str, torch.Tensor], Any]  # (buffers by name, extra)
Received = Mapping[str, Callable[[], bytes]]  # {side file name: its bytes, held in memory (received from a peer)}


def encode_extra(value: Any, where: str = "extra") -> tuple[str, dict[str, torch.Tensor]]:
    """``value`` as JSON text with each tensor replaced by a reference, and the tensors (CPU, contiguous)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(value, tensors, where, 0)
    return json.dumps(tree, separators=(",", ":"), allow_nan=False), tensors


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the structure")
    if torch.is_tensor(value):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {_REF: int(key)}
    if isinstance(value, Mapping):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise TypeError(f"{where}: a dict key {bad!r} ({type(bad).__name__}); extra's dict keys must be str")
        body = {k: _encode(v, tensors, f"{where}['{k}']", depth + 1) for k, v in value.items()}
        return {"$dict": body} if any(k.startswith("$") for k in body) else body
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    try:
        return to_json(value, where)
    except ValueError as exc:
        raise TypeError(f"{exc}; extra holds dicts, lists, tuples, numbers, strings, bools, None and tensors") from None


def decode_extra(text: str, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """The value :func:`encode_extra` was given (every reference checked to name a tensor of the file)."""
    return _decode(loads(text, where=f"{where}, extra"), tensors, where, 0)  # unique keys, bounded depth


def _decode(tree: Any, tensors: Mapping[str, torch.Tensor], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: extra nested more than {MAX_DEPTH} levels deep")
    if isinstance(tree, list):
        return [_decode(v, tensors, where, depth + 1) for v in tree]
    if not isinstance(tree, dict):
        return from_json(tree, where)
    if set(tree) == {_REF}:
        name = f"{_EXTRA}{tree[_REF]}"
        if name not in tensors:
            raise ValueError(f"{where}: extra refers to tensor '{name}', which the file does not hold")
        return tensors[name]
    if set(tree) == {"$tuple"} and isinstance(tree["$tuple"], list):
        return tuple(_decode(v, tensors, where, depth + 1) for v in tree["$tuple"])
    if set(tree) == {"$dict"} and isinstance(tree["$dict"], dict):
        return {k: _decode(v, tensors, where, depth + 1) for k, v in tree["$dict"].items()}
    if any(k.startswith("$") for k in tree):
        return from_json(tree, where)  # a tagged scalar ($float, $complex, $tensor) or a refusal naming it
    return {k: _decode(v, tensors, where, depth + 1) for k, v in tree.items()}


def _file_digest(data: bytes) -> str:
    return f"xxh3-128:{xxhash.xxh3_128(data).hexdigest()}"


def write_side_file(
    directory: Path,
    *,
    save_id: str,
    rank: int,
    world_size: int,
    buffers: Mapping[str, torch.Tensor],
    extra: tuple[str, Mapping[str, torch.Tensor]],
    durable: bool = True,
) -> FileRecord:
    """Write one rank's side file atomically (``durable=False``: no fsync, for a file staged for an upload); its
    record for the manifest (digest of the file's bytes)."""
    text, extra_tensors = extra
    tensors = {_BUFFER + n: _owned(t) for n, t in buffers.items()}
    tensors.update({_EXTRA + k: t for k, t in extra_tensors.items()})
    metadata = {
        "format": "fsdp_optim", "kind": "side", "version": "1", "save_id": save_id,
        "rank": str(rank), "world_size": str(world_size), "extra": text,
    }  # fmt: skip
    data = save_safetensors(tensors, metadata)
    name = side_file_name(save_id, rank, world_size)
    size, checksum = atomic_write(directory / name, lambda f: (f.write(data), _file_digest(data))[1], durable=durable)
    return FileRecord(rank, name, checksum, size)


def _owned(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous()


def read_side_file(directory: Where, record: FileRecord, received: Received | None = None) -> SideContent:
    """``(buffers, extra)`` of a side file (local, or an object in a store, or ``received[name]()``: its bytes as
    the caller holds them), after checking its size and digest against ``record``."""
    path = directory / record.file
    data = received[record.file]() if received and record.file in received else _read_exactly(directory, record)
    if len(data) != record.nbytes or _file_digest(data) != record.checksum:
        raise ValueError(f"{path}: checksum mismatch (the side file is damaged or was modified)")
    tensors = load_safetensors(data)
    header_size = int.from_bytes(data[:8], "little")
    metadata = loads(data[8 : 8 + header_size], where=f"{path}, header").get("__metadata__", {})
    where = f"{path}"
    buffers = {n[len(_BUFFER) :]: t for n, t in tensors.items() if n.startswith(_BUFFER)}
    extra = decode_extra(metadata.get("extra", "null"), tensors, where)
    return buffers, extra


def _read_exactly(directory: Where, record: FileRecord) -> bytes:
    """The side file's bytes, refused when it is not of the size the manifest records."""
    path = directory / record.file
    if isinstance(directory, ObjectStore):
        size = directory.size(record.file)
        if size is None:
            raise FileNotFoundError(f"{path}: no such object (the manifest lists it as a side file)")
        if size != record.nbytes:
            raise ValueError(f"{path}: {size} bytes, but the manifest records {record.nbytes} (truncated?)")
        return bytes(directory.read_range(record.file, 0, size))
    fd, st = open_regular(Path(directory) / record.file, follow_symlinks=False)
    try:
        if st.st_size != record.nbytes:
            raise ValueError(f"{path}: {st.st_size} bytes, but the manifest records {record.nbytes} (truncated?)")
        return os.pread(fd, record.nbytes, 0)
    finally:
        os.close(fd)


def read_rank_side(
    directory: Where, training: TrainingRecord, saved_rank: int, received: Received | None = None
) -> SideContent:
    """Saved rank ``saved_rank``'s ``(buffers, extra)``: its own buffers when they were saved per rank, else rank
    0's; ``ValueError`` when the buffers found are not those the manifest lists (names, dtypes, shapes).
    ``received``: side files held in memory (see :func:`read_side_file`)."""
    buffers, extra = read_side_file(directory, training.side_file(saved_rank), received)
    if not training.buffers_per_rank and saved_rank != 0:
        buffers, _ = read_side_file(directory, training.side_file(0), received)
    specs = training.buffer_specs()
    found = {n: (dtype_to_str(t.dtype), tuple(t.shape)) for n, t in buffers.items()}
    if found != {n: (s.dtype, s.shape) for n, s in specs.items()}:
        raise ValueError(
            f"{directory}: the side files hold buffers {sorted(found.items())[:3]}..., the manifest lists "
            f"{sorted((n, (s.dtype, s.shape)) for n, s in specs.items())[:3]}...; the checkpoint is inconsistent"
        )
    return buffers, extra
