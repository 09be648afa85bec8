"""The full optimizer state by parameter name in one safetensors file
(:mod:`fsdp_optim.formats.named_safetensors`), from any source :func:`~fsdp_optim.offline.sources.open_source`
opens (:func:`to_safetensors`, one tensor at a time, through ``disk.one_file.write_stream``), and back
(:func:`load_full_state`).

Memory while converting: one state tensor, plus at most about ``max_mapped_bytes`` of pages of the source's
mapped files (a full dict file is mapped afresh whenever that many bytes were read through its mapping).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fsdp_optim.core.flatten import clone_value
from fsdp_optim.core.source import Source
from fsdp_optim.disk.atomic import atomic_write
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.local_directory import staged_output
from fsdp_optim.disk.one_file import write_stream
from fsdp_optim.formats import hf_safetensors as hf
from fsdp_optim.formats.named_safetensors.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.formats.named_safetensors.writer import prepare_named_safetensors
from fsdp_optim.formats.safetensors_container import Tensor as ModelTensor
from fsdp_optim.formats.safetensors_container import check_portable
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.opened.base import Opened
from fsdp_optim.offline.operations import load_full_file
from fsdp_optim.offline.publish import output_for
from fsdp_optim.offline.sources import open_source

__all__ = ["load_full_state", "to_safetensors"]


def to_safetensors(
    source: str | os.PathLike[str] | Mapping[str, Any],
    out: str | os.PathLike[str],
    *,
    layout: LayoutLike | None = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
    progress: Callable[[], None] | None = None,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    max_shard_size: int | str | None = None,
) -> int:
    """Write ``source`` as one named safetensors file ``out`` (tensors ``<param name>/<state key>``); returns its size.

    A whole checkpoint (:func:`fsdp_optim.save_checkpoint`) is written as a directory ``out`` instead (returns the
    bytes of its files): the model as Hugging Face stores it (``model.safetensors``, or above ``max_shard_size``,
    default ``"5GB"``, ``model-0000k-of-0000N.safetensors`` files and ``model.safetensors.index.json``; see
    :mod:`fsdp_optim.formats.hf_safetensors`) and the optimizer as ``optimizer.safetensors`` in the named format
    below. The model files hold the unwrapped ``state_dict()``: tied names as copies of their parameter (safetensors
    shares no storage; ``load_state_dict(strict=True)`` needs every name) and rank 0's buffers.

    The full dict's hyperparameters, ids, key order, scalars (0-dim tensors as tensors, Python numbers as
    numbers) and ``"fsdp_optim"`` block come back from :func:`load_full_state` bit for bit. Refused before
    ``out`` is touched: per-rank state (MoE experts), dtypes and hyperparameters the format cannot hold.
    A shard set's wrapper extras (``loss_scale``) and other keys are not kept. ``layout``, ``optimizer`` and
    ``allow_globals`` apply as :mod:`fsdp_optim.offline.sources` says (a fairscale-native dict needs ``layout``).
    """
    with output_for(str(out)) as local, open_source(  # out, or written locally, then uploaded (offline/publish.py)
        source, layout=layout, optimizer=optimizer, allow_globals=allow_globals, max_mapped_bytes=max_mapped_bytes
    ) as opened:
        given = None if isinstance(source, Mapping) else source
        return write_opened(opened, local, inputs=(source,), progress=progress, path=given, bound=max_mapped_bytes,
                            max_shard_size=max_shard_size)


def write_opened(
    opened: Opened,
    out: str | os.PathLike[str],
    *,
    inputs: Sequence[Any] = (),
    progress: Callable[[], None] | None = None,
    path: str | os.PathLike[str] | None = None,
    bound: int = DEFAULT_MAPPED_BYTES,
    max_shard_size: int | str | None = None,
    overwrite: bool = True,
) -> int:
    """:func:`to_safetensors` of a source already opened by :func:`~fsdp_optim.offline.sources.open_source`
    (``path``: the full dict file it was opened from, mapped afresh every ``bound`` bytes read; ``overwrite``:
    whether an existing output file is replaced, else refused)."""
    if opened.source is None:
        raise ValueError(f"{opened.label}: a {opened.kind.value} holds no optimizer state to convert")
    if opened.is_whole():
        return write_whole_safetensors(opened, out, inputs=inputs, progress=progress, max_shard_size=max_shard_size)
    if max_shard_size is not None:
        raise ValueError(f"max_shard_size: {opened.label} holds no model weights (it applies to a whole checkpoint)")
    the_source, trim = opened.source, opened.trim
    if opened.is_full_dict() and path is not None:
        the_source, trim = _MappedFullDict(path, bound).source(opened.source)
    prepared = prepare_named_safetensors(the_source, order=opened.order, header=opened.named_header())

    def write(f: BinaryIO) -> None:
        prepared.write(f, trim=trim, progress=progress)

    return write_stream(write, out, inputs=inputs, purpose="fsdp_optim.to_safetensors", overwrite=overwrite)


def write_whole_safetensors(
    opened: Opened,
    out: str | os.PathLike[str],
    *,
    inputs: Sequence[Any],
    progress: Callable[[], None] | None,
    max_shard_size: int | str | None,
) -> int:
    """A whole checkpoint as a directory of model files and ``optimizer.safetensors`` (see :func:`to_safetensors`),
    all or nothing; every check (plans, dtypes, sizes) before the output is touched. Returns the bytes written."""
    if opened.source is None:
        raise ValueError(f"{opened.label}: a {opened.kind.value} holds no optimizer state to convert")
    max_bytes = hf.parse_size(hf.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    model = opened.whole_model(progress=progress)
    tensors = [ModelTensor(n, tuple(t.shape), check_portable(n, t.dtype), t.make if isinstance(t, ModelTensor)
                           else _clone(t)) for n, t in model.entries(lambda p: p).items()]  # fmt: skip
    groups = hf.shard(tensors, max_bytes)
    names = hf.file_names(len(groups))
    optimizer = prepare_named_safetensors(opened.source, order=opened.order) if model.has_optimizer else None
    files = [*names, *([hf.INDEX] if len(groups) > 1 else []), *(["optimizer.safetensors"] if optimizer else [])]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with staged_output(out, hf.HF_DIRECTORY, purpose="fsdp_optim.to_safetensors", inputs=inputs,
                       entry=JournalEntry(files=tuple(files))) as stage:  # fmt: skip
        stage.last = (hf.INDEX if len(groups) > 1 else hf.SINGLE,)
        for name, group in zip(names, groups):
            atomic_write(stage.dir / name, partial(hf.write_hf_file, tensors=group, after=opened.trim), in_place=True)
        if len(groups) > 1:
            data = hf.index(groups)
            atomic_write(stage.dir / hf.INDEX, lambda f: f.write(data), in_place=True)
        if optimizer is not None:
            write_optimizer = partial(optimizer.write, trim=opened.trim)
            atomic_write(stage.dir / "optimizer.safetensors", write_optimizer, in_place=True)
        return sum((stage.dir / n).stat().st_size for n in files)


def _clone(tensor: Any) -> Callable[[], torch.Tensor]:
    return lambda: tensor.detach().clone().contiguous()


class _MappedFullDict:
    """A full dict file read through ``torch.load(mmap=True)``, mapped afresh once ``bound`` bytes were read:
    dropping the old mapping releases the pages it touched, which count in the process's resident memory."""

    def __init__(self, path: str | os.PathLike[str], bound: int) -> None:
        self.path, self.bound = path, bound
        self.full: Mapping[str, Any] | None = None
        self._read = 0

    def source(self, first: Source) -> tuple[Source, Callable[[], None]]:
        """``first`` (the planning source of the same file) reading through this mapping, and its trim."""
        full = load_full_file(self.path, disjoint=True)
        ids = list(full["param_names"])
        if [full["param_names"][i] for i in ids] != [f.params[0].name for f in first.flats]:
            raise ValueError(f"{self.path}: the file changed while it was read (its parameters differ)")
        self.full = full

        def read(i: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
            if self.full is None:
                self.full = load_full_file(self.path, disjoint=True)
            out.copy_(self.full["state"][ids[i]][key].reshape(-1)[start:stop])
            self._read += out.numel() * out.element_size()

        # Scalars (0-dim tensors) would keep a mapping, and every page read through it, alive: copy them.
        flats = tuple(
            replace(f, state=tuple(replace(e, value=clone_value(e.value)) for e in f.state)) for f in first.flats
        )
        return replace(first, flats=flats, read=read), self.trim

    def trim(self) -> None:
        if self._read > self.bound:
            self.full, self._read = None, 0


def load_full_state(
    path: str | os.PathLike[str],
    *,
    layout: LayoutLike | None = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
) -> dict[str, Any]:
    """The full dict (``{"state", "param_groups", "param_names", "fsdp_optim"}``, as ``gather_full_optim_state_dict``
    returns it; every tensor new CPU memory) from a named safetensors file, a full dict file, a sharded
    checkpoint directory, a fairseq/metaseq shard set or a fairscale-native dict (with ``layout``). Offline: no
    process group, no model. Every byte read is checked against the file's checksums; errors name the file.
    """
    with open_source(path, layout=layout, optimizer=optimizer, allow_globals=allow_globals) as opened:
        if opened.is_full_dict():
            return load_full_file(path, opened.label, mmap=False)  # into memory, not mapped
        return opened.full_state()
