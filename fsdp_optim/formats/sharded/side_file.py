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
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.disk.atomic import HashingWriter, atomic_write
from fsdp_optim.disk.json_input import loads
from fsdp_optim.disk.location import Location, Where, non_objects
from fsdp_optim.formats.safetensors_container import DTYPE_NAMES, encode_header
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.json_values import from_json, to_json
from fsdp_optim.formats.sharded.rank_file import Pieces, host_pieces
from fsdp_optim.formats.sharded.training import TrainingRecord, side_file_name

__all__ = [
    "BUFFER_CHOICES", "MAX_DEPTH", "SideContent", "buffers_rule", "check_buffer_choice", "decode_extra",
    "encode_extra", "mean_buffers", "read_rank_side", "read_side_file", "side_ranks", "write_side_file",
]  # fmt: skip

MAX_DEPTH = 64  # levels of nesting in ``extra``
_REF = "$extra"
_BUFFER, _EXTRA = "buffers/", "extra/"
SideContent = tuple[dict[str, torch.Tensor], Any]  # (buffers by name, extra)
Received = Mapping[str, Callable[[], bytes]]  # {side file name: its bytes, held in memory (received from a peer)}


def encode_extra(value: Any, where: str = "extra") -> tuple[str, dict[str, torch.Tensor]]:
    """``value`` as JSON text with each tensor replaced by a reference, and the tensors as they are (detached: an
    async save copies them at the call, :meth:`fsdp_optim.job.staging.HostStaging.side_copy`;
    :func:`write_side_file` copies one on a GPU through the pieces it is given)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(value, tensors, where, 0)
    return json.dumps(tree, separators=(",", ":"), allow_nan=False), tensors


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the structure")
    if torch.is_tensor(value):
        key = str(len(tensors))
        tensors[key] = value.detach()
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
    pieces: Pieces = host_pieces,
) -> FileRecord:
    """Write one rank's side file atomically (``durable=False``: no fsync, for a file staged for an upload); its
    record for the manifest (digest of the file's bytes).

    Streamed: the header first, then each tensor's bytes as ``pieces`` hands them over (host tensors where they are;
    a job's stager copies those on a GPU through its pinned ring), hashed while a thread writes them. No tensor is
    copied into pageable memory, and the file is never built in memory."""
    text, extra_tensors = extra
    tensors = {_BUFFER + n: t.detach() for n, t in buffers.items()}
    tensors.update({_EXTRA + k: t.detach() for k, t in extra_tensors.items()})
    for key, t in tensors.items():
        if t.dtype not in _SIDE_DTYPES:
            raise TypeError(f"{key}: a {t.dtype} tensor, which a side file (safetensors) cannot hold")
    metadata = {
        "format": "fsdp_optim", "kind": "side", "version": "1", "save_id": save_id,
        "rank": str(rank), "world_size": str(world_size), "extra": text,
    }  # fmt: skip
    header = encode_header(metadata, ((k, t.dtype, t.shape) for k, t in tensors.items()), names=_SIDE_DTYPES)
    parts = [t.reshape(-1) for t in tensors.values() if t.numel()]
    name = side_file_name(save_id, rank, world_size)
    size, checksum = atomic_write(directory / name, partial(_stream, header, parts, pieces), durable=durable)
    return FileRecord(rank, name, checksum, size)


_SIDE_DTYPES = {**DTYPE_NAMES, torch.complex64: "C64"}  # what safetensors writes (complex64 too, unlike rank files)


def _stream(header: bytes, parts: Sequence[torch.Tensor], pieces: Pieces, file: BinaryIO) -> str:
    """``header`` then the bytes of ``parts`` written to ``file``; the digest of all of them (:func:`_file_digest`)."""
    hasher = xxhash.xxh3_128(header)
    file.write(header)
    with HashingWriter(file) as writer:
        for piece in pieces(parts) if parts else ():
            writer.put(memoryview(piece.numpy()), hasher.update)  # type: ignore[arg-type]
    return f"xxh3-128:{hasher.hexdigest()}"


def read_side_file(directory: Location, record: FileRecord, received: Received | None = None) -> SideContent:
    """``(buffers, extra)`` of a side file (local, or an object in a store, or ``received[name]()``: its bytes as
    the caller holds them), after checking its size and digest against ``record``."""
    path = directory / record.file
    data = received[record.file]() if received and record.file in received else _read_exactly(directory, record)
    if len(data) != record.nbytes or _file_digest(data) != record.checksum:
        raise ValueError(f"{path}: checksum mismatch (the side file is damaged or was modified)")
    from safetensors.torch import load as load_safetensors  # (a side file read: the only use of the library here)

    tensors = load_safetensors(data)
    header_size = int.from_bytes(data[:8], "little")
    metadata = loads(data[8 : 8 + header_size], where=f"{path}, header").get("__metadata__", {})
    buffers = {n[len(_BUFFER) :]: t for n, t in tensors.items() if n.startswith(_BUFFER)}
    extra = decode_extra(metadata.get("extra", "null"), tensors, str(path))
    return buffers, extra


def _read_exactly(place: Location, record: FileRecord) -> bytes:
    """The side file's bytes, refused when it is not of the size the manifest records."""
    path = place / record.file
    size = place.size(record.file)
    if size is None and record.file in non_objects(place):  # a symlink (never followed), a directory...
        raise ValueError(f"{path}: not a regular file, expected one (the manifest lists it as a side file)")
    if size is None:
        raise FileNotFoundError(f"{path}: no such file (the manifest lists it as a side file)")
    if size != record.nbytes:
        raise ValueError(f"{path}: {size} bytes, but the manifest records {record.nbytes} (truncated?)")
    return bytes(place.read_range(record.file, 0, size))


# What a load at another world size (or a reshard to one) does with buffers saved per rank (they differed across
# the saved ranks: BatchNorm's running statistics over each rank's data): refuse, saved rank 0's, or the mean.
BUFFER_CHOICES = ("refuse", "rank0", "mean")
OWN = "own"  # the rule where no choice is needed: each rank its own (saved world size), or the one shared copy


def buffers_rule(training: TrainingRecord, saved_world: int, world: int, choice: str, where: str) -> str:
    """How a load by ``world`` ranks (or a reshard to ``world``) of a checkpoint saved by ``saved_world`` finds its
    buffers: ``"own"`` (shared buffers, or per-rank ones at the saved world size: each rank its own), else the
    caller's ``choice`` (``"rank0"`` or ``"mean"``); ``ValueError`` for a choice that is none of
    :data:`BUFFER_CHOICES`, or for ``"refuse"`` where a choice is needed (the message names the option)."""
    check_buffer_choice(choice)
    if not training.buffers_per_rank or saved_world == world:
        return OWN
    if choice == "refuse":
        raise ValueError(
            f"buffers: {where}: its buffers differed across its {saved_world} ranks (each rank saved its own, as "
            f"BatchNorm's running statistics do), so world size {world} needs a choice: buffers='rank0' (--buffers "
            f"rank0) gives every rank saved rank 0's, buffers='mean' (--buffers mean) the mean across the saved "
            f"ranks of each floating-point buffer (rank 0's of the others)"
        )
    return choice


def check_buffer_choice(choice: str) -> None:
    """``ValueError`` unless ``choice`` is one of :data:`BUFFER_CHOICES`."""
    if choice not in BUFFER_CHOICES:
        raise ValueError(f"buffers: expected one of {', '.join(map(repr, BUFFER_CHOICES))}, found {choice!r}")


def side_ranks(training: TrainingRecord, saved_world: int, saved_rank: int, rule: str) -> list[int]:
    """The saved ranks whose side files :func:`read_rank_side` reads for ``saved_rank`` under ``rule``."""
    if rule == "mean":
        return list(range(saved_world))
    if rule == OWN and training.buffers_per_rank:
        return [saved_rank]
    return sorted({saved_rank, 0})


def mean_buffers(per_rank: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each floating-point buffer's mean across ``per_rank`` (summed in float64, then cast back to its dtype); every
    other buffer (integers such as ``num_batches_tracked``, bools) as in ``per_rank[0]``."""
    first = per_rank[0]
    out: dict[str, torch.Tensor] = {}
    for name, value in first.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        total = torch.zeros(value.shape, dtype=torch.float64)
        for buffers in per_rank:
            total += buffers[name].to(torch.float64)
        out[name] = (total / len(per_rank)).to(value.dtype)
    return out


def read_rank_side(
    directory: Location, training: TrainingRecord, saved_rank: int, received: Received | None = None, *, rule: str = OWN
) -> SideContent:
    """Saved rank ``saved_rank``'s ``extra`` with the buffers ``rule`` (:func:`buffers_rule`) gives: ``"own"``: its
    own when they were saved per rank, else rank 0's; ``"rank0"``: rank 0's; ``"mean"``: :func:`mean_buffers` of
    every saved rank's. ``ValueError`` when the buffers found are not those the manifest lists (names, dtypes,
    shapes). ``received``: side files held in memory (see :func:`read_side_file`)."""
    buffers, extra = read_side_file(directory, training.side_file(saved_rank), received)
    if rule == "mean":
        files = range(len(training.files))
        per_rank = [
            buffers if r == saved_rank else read_side_file(directory, training.side_file(r), received)[0] for r in files
        ]
        for each in per_rank:
            _check_buffers(directory, training, each)
        return mean_buffers(per_rank), extra
    if (rule == "rank0" or not training.buffers_per_rank) and saved_rank != 0:
        buffers, _ = read_side_file(directory, training.side_file(0), received)
    _check_buffers(directory, training, buffers)
    return buffers, extra


def _check_buffers(directory: Where, training: TrainingRecord, buffers: Mapping[str, torch.Tensor]) -> None:
    specs = training.buffer_specs()
    found = {n: (dtype_to_str(t.dtype), tuple(t.shape)) for n, t in buffers.items()}
    if found != {n: (s.dtype, s.shape) for n, s in specs.items()}:
        raise ValueError(
            f"{directory}: the side files hold buffers {sorted(found.items())[:3]}..., the manifest lists "
            f"{sorted((n, (s.dtype, s.shape)) for n, s in specs.items())[:3]}...; the checkpoint is inconsistent"
        )
