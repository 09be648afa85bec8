"""Read a named safetensors optimizer file as a planning source, range by range, every byte it uses checked.

:class:`NamedSafetensors` checks the whole header first, then reads through ``safetensors.safe_open`` (mapped):
``read_flat`` copies elements ``[start, stop)`` of one tensor with ``get_slice`` reads of just those bytes (a flat
range of an n-dim tensor is at most ``2n - 1`` slices). Each piece is checked once: a tensor of at most
``chunk_bytes`` (1 MiB) whole against its digest, a larger one per chunk, reading the chunks that cover the range
(a rank's range costs its bytes plus at most 2 MiB). ``get_slice`` hands out views of a private mapping, so callers
copy what they keep; the file is closed (its pages dropped) once the bytes read exceed ``max_mapped_bytes``."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from fsdp_optim.core.checksums import digest_matches
from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.flatten import StateKind, clone_value
from fsdp_optim.core.layout import ParamSpec
from fsdp_optim.core.plan import per_parameter, plan
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.source import Source
from fsdp_optim.disk.untrusted import open_regular
from fsdp_optim.formats.fullstate import build_full_state
from fsdp_optim.formats.named_safetensors.document import Entry, FormatError, TensorInfo, read_named_header
from fsdp_optim.formats.sharded.segments import chunk_elements
from fsdp_optim.formats.sharded.side_file import decode_extra

__all__ = ["ChecksumError", "NamedSafetensors", "is_named_safetensors", "tie_copies"]

DEFAULT_MAPPED_BYTES = 64 << 20


class ChecksumError(ValueError):
    """Bytes of a tensor that do not match the checksum the file recorded for them."""


def is_named_safetensors(path: Any) -> bool:
    """Whether ``path`` is a file that starts like a safetensors file (a length, then ``{``); the rest is unchecked."""
    try:
        fd, _ = open_regular(path)
    except (OSError, TypeError, ValueError):
        return False
    try:
        head = os.pread(fd, 9, 0)
    finally:
        os.close(fd)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") >= 2


class NamedSafetensors:
    """A named safetensors optimizer file opened for reading; a context manager (``close`` drops the mapping)."""

    def __init__(self, path: str | os.PathLike[str], *, max_mapped_bytes: int = DEFAULT_MAPPED_BYTES) -> None:
        self.path = str(path)
        self.document, self.tensors = read_named_header(path)
        self.max_mapped_bytes = max_mapped_bytes
        self._handle: Any = None
        self._mapped = 0
        self._whole: set[str] = set()  # tensors checked whole
        self._chunks: set[tuple[str, int]] = set()  # (tensor, chunk) checked
        self._scalars = {e.tensor: self._read_scalar(e.tensor) for es in self.document.state.values() for e in es
                         if e.kind == "scalar" and e.tensor is not None}  # fmt: skip

    def __enter__(self) -> NamedSafetensors:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None
        self._mapped = 0

    def scalar(self, name: str, key: str) -> Any:
        """Parameter ``name``'s scalar state ``key`` (a 0-dim tensor or a Python number), ``None`` if it has none."""
        entry = next((e for e in self.document.state.get(name, ()) if e.key == key and e.kind == "scalar"), None)
        if entry is None:
            return None
        return self._scalars[entry.tensor] if entry.tensor is not None else entry.value

    def trim(self) -> None:
        """Close the file (dropping its mapped pages) once the bytes read since the last close exceed the bound."""
        if self._mapped > self.max_mapped_bytes:
            self.close()

    # -----------------------------------------------------------------------------------------------
    # Reading

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened, the bytes they come from checked.

        May be a view of the file's private (copy-on-write) mapping, which it keeps alive: copy what you keep."""
        info = self.tensors[name]
        if not 0 <= start <= stop <= info.numel:
            raise IndexError(f"{self.path}: tensor '{name}' has {info.numel} elements, asked for [{start}, {stop})")
        if name in self._whole:
            return self._read(name, info, start, stop)
        if not info.chunks or (start, stop) == (0, info.numel):
            whole = self._read(name, info, 0, info.numel)
            self._check(name, whole.view(info.shape), info.digest, 0, info.nbytes)
            self._whole.add(name)
            return whole[start:stop] if (start, stop) != (0, info.numel) else whole
        per = chunk_elements(info.dtype, self.document.chunk_bytes)
        first, last = start // per, math.ceil(stop / per)
        if all((name, c) in self._chunks for c in range(first, last)):
            return self._read(name, info, start, stop)
        lo, hi = first * per, min(last * per, info.numel)
        covering = self._read(name, info, lo, hi)
        for c in range(first, last):
            piece = covering[c * per - lo : min((c + 1) * per, info.numel) - lo]
            if (name, c) not in self._chunks:
                nbytes = piece.numel() * info.dtype.itemsize
                self._check(name, piece, info.chunks[c], c * self.document.chunk_bytes, nbytes)
                self._chunks.add((name, c))
        return covering[start - lo : stop - lo].clone() if (lo, hi) != (start, stop) else covering

    def check_every_checksum(self) -> int:
        """Read every tensor and check every checksum the file records for it (each chunk, then the whole
        digest), the mapping trimmed as it goes; raises :class:`ChecksumError` for the first failing piece.
        Returns the number of tensors checked."""
        for name, info in self.tensors.items():
            per = chunk_elements(info.dtype, self.document.chunk_bytes)
            for c in range(len(info.chunks)):  # a tensor over chunk_bytes has 2 or more chunks
                self.read_flat(name, c * per, min((c + 1) * per, info.numel))
                self.trim()
            self._whole.discard(name)
            self.read_flat(name, 0, info.numel)
            self.trim()
        return len(self.tensors)

    def _check(self, name: str, tensor: torch.Tensor, expected: str, offset: int, nbytes: int) -> None:
        if not digest_matches(tensor, expected):
            raise ChecksumError(
                f"{self.path}: tensor '{name}' fails its checksum in bytes [{offset}, {offset + nbytes}) of its data "
                f"(recorded {expected}); the file is corrupt or was modified"
            )

    def _read(self, name: str, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        if self._handle is None:
            self._handle = safe_open(self.path, framework="pt", device="cpu")
        if not info.shape:
            out = self._handle.get_slice(name)[()].reshape(-1)
        else:
            parts = [self._handle.get_slice(name)[index].reshape(-1) for index in _pieces(info.shape, start, stop, ())]
            out = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0, dtype=info.dtype)
        self._mapped += out.numel() * info.dtype.itemsize
        if out.numel() != stop - start or out.dtype != info.dtype:  # the file changed since its header was checked
            raise FormatError(
                f"{self.path}: tensor '{name}' elements [{start}, {stop}): expected {stop - start} {info.dtype} "
                f"elements, read {out.numel()} {out.dtype} (the file changed while being read?)"
            )
        return out

    def _read_scalar(self, name: str) -> torch.Tensor:
        return self.read_flat(name, 0, 1).reshape(()).clone()  # 0-dim (read_named_header checks); not a view of the map

    # -----------------------------------------------------------------------------------------------
    # As a planning source, and as a full dict

    def source(self) -> Source:
        """The file as a planning source: one flat per parameter (world size 1), ``read`` through :meth:`read_flat`."""
        doc = self.document
        flats = tuple(self._record(name, doc.state.get(name, ())) for name in doc.param_order)
        index = {name: i for i, name in enumerate(doc.param_order)}
        groups = tuple(
            GroupRecord(dict(g.hyperparams), tuple(index[n] for n in g.params), named=g.named) for g in doc.groups
        )
        tensor_of = {(index[name], e.key): e.tensor for name, es in doc.state.items() for e in es if e.tensor}

        def read(i: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
            out.copy_(self.read_flat(tensor_of[(i, key)], start, stop))  # type: ignore[arg-type]

        return Source(self.path, doc.optimizer, flats, groups, read, shapes_known=doc.shapes_known)

    def _record(self, name: str, entries: tuple[Entry, ...]) -> FlatRecord:
        state = []
        for e in entries:
            if e.kind == StateKind.SHARDED.value:
                info = self.tensors[e.tensor]  # type: ignore[index]
                state.append(StateEntry(e.key, StateKind.SHARDED, dtype=dtype_to_str(info.dtype), shape=info.shape))
            else:
                value = self._scalars[e.tensor].clone() if e.tensor is not None else e.value
                state.append(StateEntry(e.key, StateKind.SCALAR, value=value))
        dtypes = [self.tensors[e.tensor].dtype for e in entries if e.kind == StateKind.SHARDED.value and e.tensor]
        spec = ParamSpec(name, self.document.shapes.get(name, ()), 0)
        dtype = dtypes[0] if dtypes else torch.float32
        return FlatRecord(unit="", params=(spec,), world_size=1, rank=None, dtype=dtype, flattened=False,
                          state=tuple(state))

    def full_state(self) -> dict[str, Any]:
        """The full dict the file was written from (as ``gather_full_optim_state_dict`` returns it), bit for bit:
        planned like any source, each tensor read whole, checked and copied (new memory)."""
        doc = self.document
        source = self.source()
        rank = {name: i for i, name in enumerate(doc.param_order)}
        target = per_parameter(source, doc.param_order)
        the_plan = plan(source, target, order=[rank[f.params[0].name] for f in target.flat_params])
        tensor_of = {(name, e.key): e.tensor for name, es in doc.state.items() for e in es if e.tensor is not None}
        flat_states: dict[int, dict[str, Any]] = {}
        for t, flat_plan in the_plan.flats.items():
            name = target.flat_params[t].params[0].name
            entries: dict[str, Any] = {}
            for e in flat_plan.entries:
                if e.kind is StateKind.SCALAR:
                    entries[e.key] = clone_value(e.value)
                else:
                    tensor = tensor_of[(name, e.key)]
                    # A copy: the view would keep the file's mapping, and every page of it, alive.
                    entries[e.key] = self.read_flat(tensor, 0, self.tensors[tensor].numel).clone()
                    self.trim()
            flat_states[t] = entries
        full = build_full_state(target, the_plan.groups, flat_states, optimizer=doc.optimizer)
        full["fsdp_optim"] = dict(doc.header)
        return full

    def whole_dict(self) -> dict[str, Any] | None:
        """A consolidated whole checkpoint (the document's ``"whole"`` section) as consolidate's ``.pt`` file holds
        it, each tensor read whole, checked and copied; ``None`` for a file of optimizer state alone::

            {"model": {"embed.weight": T[11, 6], ..., "head.weight": <embed.weight's tensor>, "block1.seen": T[4]},
             "optimizer": <the full dict, as full_state()>, "extra": <the saved rank's extra>}

        A tied name is its parameter's tensor (one object, as ``state_dict()`` gives it): the file lists the pairs;
        a file that does not (written before it did) ties a name that is no parameter to the parameter whose
        dtype, shape and bytes it has."""
        whole = self.document.whole
        if whole is None:
            return None
        model = {name: self._whole_tensor(name) for name in whole.model}
        if whole.aliases is not None:
            model.update({alias: model[name] for alias, name in whole.aliases})
        else:  # a file written before it listed them
            model = tie_copies(model, set(self.document.param_order))
        extras = {name: self._whole_tensor(name) for name in whole.extra_tensors}
        extra = decode_extra(whole.extra, extras, f"{self.path}: the 'whole' section")
        return {"model": model, "optimizer": self.full_state(), "extra": extra}

    def _whole_tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        try:
            return self.read_flat(name, 0, info.numel).clone().reshape(info.shape)
        finally:
            self.trim()


def tie_copies(model: dict[str, torch.Tensor], params: set[str]) -> dict[str, torch.Tensor]:
    """``model`` with each name that is no parameter but holds a copy of a parameter's tensor (its dtype, shape and
    bytes: a tied name, as safetensors files keep one) made that parameter's tensor, as ``state_dict()`` gives it."""
    out = dict(model)
    for name, tensor in model.items():
        if name not in params:
            owner = next((p for p in model if p in params and _same_bytes(model[p], tensor)), None)
            out[name] = model[owner] if owner is not None else tensor
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))  # fmt: skip


def _pieces(shape: tuple[int, ...], start: int, stop: int, prefix: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """Index tuples whose ``get_slice`` reads, flattened and joined, are elements ``[start, stop)`` of a tensor."""
    if start >= stop:
        return
    inner = math.prod(shape[1:])
    if start % inner == 0 and stop % inner == 0:
        yield (*prefix, slice(start // inner, stop // inner))
        return
    row = start // inner
    if start % inner:  # a partial first row
        end = min(stop, (row + 1) * inner)
        yield from _pieces(shape[1:], start - row * inner, end - row * inner, (*prefix, row))
        if end == stop:
            return
        row += 1
    full_rows = stop // inner
    if full_rows > row:
        yield (*prefix, slice(row, full_rows))
    if stop % inner:  # a partial last row
        yield from _pieces(shape[1:], 0, stop - full_rows * inner, (*prefix, full_rows))
