"""Write a ``torch.save`` file one tensor at a time: :func:`stream_save` and :class:`Pending`.

``torch.save(obj)`` needs every tensor of ``obj`` in memory at once. A file that ``torch.load`` reads is a
zip archive of ``data.pkl`` (the object, each tensor's storage replaced by a reference ``("storage",
FloatStorage, key, "cpu", numel)``) and one record ``data/<key>`` per storage, read by name. So the pickle
can be written first from shapes and dtypes alone, and each storage produced, written and freed in turn:
memory stays at one tensor, whatever the file's size. Records are written in key order (what
``.format_version`` 1 promises) and aligned as ``torch.save`` aligns them, so ``torch.load(mmap=True,
weights_only=True)`` reads the result like any other file.

The archive is written through ``torch.serialization``'s own zip writer (``_open_zipfile_writer``, private
to torch): this module is the only user, so a change in torch touches one function.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

import torch

from fsdp_optim.disk.atomic import atomic_write

__all__ = ["Pending", "stream_save", "stream_write"]

_PROTOCOL = 2  # torch.save's default


@dataclass(frozen=True, eq=False)
class Pending:
    """A tensor not made yet: ``produce()`` returns it (a new CPU tensor of ``shape`` and ``dtype``) when its
    bytes are written. Placing one object at several places of ``obj`` writes one storage that they share."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


class _Storage:
    def __init__(self, pending: Pending) -> None:
        self.pending = pending


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickler (storages by persistent id), plus :class:`Pending` as a tensor with a storage to
    come."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__(buffer, protocol=_PROTOCOL)
        self.records: dict[str, Pending | torch.UntypedStorage] = {}
        self._keys: dict[Any, str] = {}

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, Pending):
            stride = tuple(math.prod(obj.shape[i + 1 :]) for i in range(len(obj.shape)))
            args: tuple[Any, ...] = (_Storage(obj), 0, torch.Size(obj.shape), stride, False, collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args
        return NotImplemented

    def persistent_id(self, obj: object) -> object:
        if isinstance(obj, _Storage):
            key = self._key(id(obj.pending), obj.pending)
            name = torch.storage._dtype_to_storage_type_map()[obj.pending.dtype]
            return ("storage", getattr(torch, name), key, "cpu", math.prod(obj.pending.shape))
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage
            if untyped.device.type != "cpu":
                raise ValueError(f"stream_save writes CPU tensors only, found one on {untyped.device}")
            key = self._key(untyped._cdata, untyped)
            return ("storage", getattr(torch, obj._pickle_storage_type()), key, "cpu", obj._size())
        return None

    def _key(self, identity: object, record: Pending | torch.UntypedStorage) -> str:
        if identity not in self._keys:
            self._keys[identity] = str(len(self.records))
            self.records[self._keys[identity]] = record
        return self._keys[identity]


def stream_save(obj: object, path: str | os.PathLike[str], *, after_tensor: Callable[[], None] | None = None) -> int:
    """Write ``obj`` (:class:`Pending` placeholders, ordinary values and CPU tensors) to the new file ``path`` as
    ``torch.save`` would, producing each :class:`Pending` only when its bytes are written (``after_tensor`` runs
    after each). Flushed and ``fsync``-ed; returns the file's size."""
    write = partial(stream_write, obj, after_tensor=after_tensor, where=str(path))
    return atomic_write(path, write, in_place=True)[0]


def stream_write(
    obj: object, f: BinaryIO, *, after_tensor: Callable[[], None] | None = None, where: str = "the output"
) -> None:
    """:func:`stream_save` into an open binary file ``f`` (the caller's output: it flushes and syncs)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    data = buffer.getvalue()
    with torch.serialization._open_zipfile_writer(f) as archive:
        archive.write_record("data.pkl", data, len(data))
        archive.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key in sorted(pickler.records, key=int):
            record = pickler.records[key]
            if isinstance(record, Pending):
                storage = _produced(record, where)
                archive.write_record(f"data/{key}", storage, storage.nbytes())
                del storage
                if after_tensor is not None:
                    after_tensor()
            else:
                archive.write_record(f"data/{key}", record, record.nbytes())


def _produced(record: Pending, where: str) -> torch.UntypedStorage:
    """The storage of ``record.produce()``, checked to be what was promised (its pickle is already written)."""
    tensor = record.produce()
    if tensor.dtype != record.dtype or tuple(tensor.shape) != record.shape or not tensor.is_contiguous():
        raise AssertionError(
            f"{where}: produced {tensor.dtype}{tuple(tensor.shape)}, promised {record.dtype}{record.shape}"
        )
    storage = tensor.untyped_storage()
    if storage.nbytes() != tensor.nbytes:  # a producer's (the caller's) tensor, checked for real
        raise ValueError(
            f"{where}: a produced tensor must own its storage: expected {tensor.nbytes} bytes of "
            f"storage, found {storage.nbytes()}"
        )
    return storage
