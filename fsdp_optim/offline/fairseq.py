"""The public fairseq / metaseq entry points: the adapter of :mod:`fsdp_optim.formats.fairseq`, with what a
caller may hand as ``param_order`` (a module, a checkpoint path) resolved to names first."""

from __future__ import annotations

import os
from typing import Any

from fsdp_optim.formats.fairseq import recut as _recut
from fsdp_optim.formats.fairseq import shards as _shards
from fsdp_optim.offline.cuts import Progress
from fsdp_optim.offline.layouts import ParamOrder, param_names

__all__ = ["ShardSet", "consolidate_shards"]


class ShardSet(_shards.ShardSetReader):
    __doc__ = _shards.ShardSetReader.__doc__

    def __init__(self, path: str | os.PathLike[str], *, param_order: ParamOrder = None, **options: Any) -> None:
        super().__init__(path, param_order=param_names(param_order), **options)


def consolidate_shards(
    path: str | os.PathLike[str], *, param_order: ParamOrder = None, with_model: bool = False,
    progress: Progress = None, **options: Any,
) -> dict[str, Any]:  # fmt: skip
    with ShardSet(path, param_order=param_order, **options) as shards:
        return _recut.consolidate_set(shards, with_model=with_model, progress=progress)


consolidate_shards.__doc__ = _recut.consolidate_set.__doc__
