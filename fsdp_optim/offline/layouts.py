"""What a caller may hand as a layout or a parameter order, resolved to names: a ``ModelLayout``, a manifest, a
fairscale-FSDP root (read through ``job.root``), a plain module, or a path to a checkpoint or layout file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch import nn

from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import Manifest

LayoutLike = ModelLayout | Manifest | nn.Module | str | os.PathLike



def resolve_layout(layout: LayoutLike) -> ModelLayout:
    """A :class:`ModelLayout` from a layout, a manifest, a fairscale-FSDP-wrapped root module, or a path
    to a sharded checkpoint directory, its manifest, or a file written by ``save_layout``."""
    if isinstance(layout, ModelLayout):
        return layout
    if isinstance(layout, Manifest):
        return layout.layout(0)
    if isinstance(layout, nn.Module):  # a live FSDP model: read in the job layer (loads the collectives)
        from fsdp_optim.job.root import verify_root

        return verify_root(layout).layout.at_rank(0)  # refuses a nested instance or a module that is not FSDP
    if isinstance(layout, (str, os.PathLike)):
        return read_manifest(layout).layout(0)
    raise TypeError(
        f"layout: expected a ModelLayout, Manifest, FSDP root module or path, found {type(layout).__name__}"
    )


ParamOrder = Sequence[str] | LayoutLike | None


def param_names(given: ParamOrder) -> tuple[str, ...] | None:
    """The unwrapped model's parameter names in ``named_parameters()`` order, from what a caller handed as
    ``param_order``: ``None`` stays ``None`` (the files' own order), names stay as given, a plain (unwrapped)
    module gives ``named_parameters()``, anything :func:`resolve_layout` takes gives its layout's order."""
    if given is None:
        return None
    if isinstance(given, nn.Module) and not _is_fsdp(given):
        return tuple(n for n, _ in given.named_parameters())
    if isinstance(given, (ModelLayout, Manifest, nn.Module, str, os.PathLike)):
        return resolve_layout(given).param_order
    if isinstance(given, Sequence) and all(isinstance(n, str) for n in given):
        return tuple(given)
    raise TypeError(
        f"param_order: expected parameter names, a module or a checkpoint path, found {type(given).__name__}"
    )


def _is_fsdp(module: nn.Module) -> bool:
    from fairscale.nn import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)
