"""consolidate's file of a whole checkpoint (``{"model", "optimizer", "extra"}``) cut back into a whole sharded
checkpoint for ``world_size`` ranks of a model's layout (:func:`fsdp_optim.reshard` with ``layout=``).

The file names no FSDP units, so the layout (a checkpoint or layout file of the model, or the wrapped model) gives
the target's units, as for a full dict. The weights ride along with the optimizer's keys (``@param``, one plan);
the side files are written after the rank files: rank 0 gets the buffers, every rank the file's ``extra`` (the one
rank's extra the file kept), so ``load_checkpoint`` of the result at any world size gives that ``extra`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_optim.core.dtypes import dtype_to_str
from fsdp_optim.core.plan import plan
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.formats.fullstate import read_meta
from fsdp_optim.formats.safetensors_container import Tensor as ModelTensor
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.side_file import encode_extra, write_side_file
from fsdp_optim.formats.sharded.training import BufferSpec, TrainingRecord
from fsdp_optim.formats.sharded.writer import write_all_or_nothing
from fsdp_optim.formats.whole_file import WholeFile
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout
from fsdp_optim.offline.rank_writes import write_ranks
from fsdp_optim.offline.whole import WholeModel

__all__ = ["reshard_whole_file", "whole_model_of"]


def reshard_whole_file(
    whole: WholeFile,
    world_size: int,
    out: Path,
    layout: LayoutLike,
    *,
    given: Any,
    progress: Callable[[], None] | None,
    overwrite: bool,
    replace_existing: bool,
    after_file: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``whole`` as a whole sharded checkpoint of ``layout``'s units for ``world_size`` ranks into ``out``
    (see the module docstring); returns its manifest. ``ValueError`` when the file does not fit the layout."""
    model = resolve_layout(layout)
    names = tuple(model.param_order)
    whole = WholeFile.of({"model": whole.model, "optimizer": whole.optimizer, "extra": whole.extra}, whole.label,
                         params=names if whole.optimizer is None else None)  # fmt: skip
    target = Manifest.from_layout(model, save_id=new_save_id()).with_world_size(world_size)
    the_plan = plan(whole.whole_source(), target.layout(0))  # every check: names, shapes, groups
    buffers = whole.buffer_tensors()
    specs = tuple(BufferSpec(n, tuple(t.shape), dtype_to_str(t.dtype)) for n, t in buffers.items())

    def write(staging: Path) -> Manifest:
        manifest = write_ranks(the_plan, target, staging, progress, after_file)
        files = tuple(
            write_side_file(staging, save_id=manifest.save_id, rank=rank, world_size=world_size,
                            buffers=buffers if rank == 0 else {}, extra=encode_extra(whole.extra))  # fmt: skip
            for rank in range(world_size)
        )
        return replace(manifest, training=TrainingRecord(specs, False, whole.aliases, files))

    return write_all_or_nothing(
        out, write, save_id=target.save_id, world_size=world_size, inputs=(given, layout), overwrite=overwrite,
        replace=replace_existing,
    )  # fmt: skip


def whole_model_of(whole: WholeFile, *, rank: int = 0) -> WholeModel:
    """A consolidated file's model as a whole checkpoint's (:class:`~fsdp_optim.offline.whole.WholeModel`), so that
    the verbs that take one (convert, consolidate to safetensors) take it: each parameter a copy made when asked,
    its tied names and buffers as the file holds them, ``extra`` of saved rank ``rank`` (the one the file kept)."""
    params = tuple(
        ModelTensor(name, tuple(whole.model[name].shape), whole.model[name].dtype, whole.model[name].clone)
        for name in whole.params
    )
    meta = read_meta(whole.optimizer, f"{whole.label}['optimizer']") if whole.optimizer is not None else None
    optimizer = None if whole.optimizer is None else (meta or {}).get("optimizer") or "unknown"
    return WholeModel(params, whole.aliases, whole.buffer_tensors(), whole.extra, rank, 1, optimizer)
