"""fsdp_optim: portable optimizer state for fairscale's FullyShardedDataParallel.

- ``gather_full_optim_state_dict(fsdp, optim)`` and ``get_shard_from_optim_state_dict(fsdp, full)`` for any
  fairscale FSDP root (fairscale's own class, a subclass such as fairseq's, or ours): no re-wrapping.
- ``FullyShardedDataParallel``: fairscale's FSDP, runnable on CPU/gloo, with the same two as methods.
- ``FORMAT_VERSION``: version of the full dict format written under the ``"fsdp_optim"`` key.
- The whole training state: ``save_checkpoint(model, optim, path, extra=...)`` / ``load_checkpoint(model, optim,
  path) -> extra`` (weights, buffers, optimizer state and loop state in one atomic sharded checkpoint, loaded at
  any world size and nesting without materializing the full model); ``async_save_checkpoint`` in the background;
  ``CheckpointManager(root, every=, keep=)`` saves one every ``every`` steps of a training loop, prunes old ones,
  and restores the newest verified one. ``ResumableSampler`` (``DistributedSampler``'s order, its position saved once
  with ``data=`` and restored at any world size keeping the global batch; ``DataPosition``, ``ResumeReport``) and
  ``sample_generator`` / ``sample_seed`` (per-sample randomness from the seed and the sample's global index).
- Optimizer checkpoints on disk: ``save_sharded_optim_state`` / ``load_sharded_optim_state`` in a job (every rank
  writes and reads its own file; resharding on load), ``scatter_full_optim_state`` (one rank reads a full
  dict, each rank receives its shard), and with no process group ``consolidate`` / ``reshard`` and
  ``verify`` (every file present, of its size, checksums matching; ``deep=True``: also what a resumed run would
  trip on); ``save_layout``, ``from_fairscale``
  (fairscale's own format) and ``to_named`` (FSDP2 / DCP); ``name_optimizer_state(optim.state_dict(), model)``
  makes a plain (non-FSDP) optimizer's state a full dict (it adds the parameter names), to load or convert.
- ``to_safetensors(source, out)`` / ``load_full_state(path)``: the full state by parameter name in one safetensors
  file (``<name>/<key>`` tensors, hyperparameters and checksums in its metadata), and any source back as a full dict.
- ``diff(a, b, atol=, rtol=)``: two sources of one model (any formats, world sizes, nesting) compared per
  parameter and state key, one tensor of each at a time: bitwise, max abs/rel error, ULP distance, NaN/Inf counts,
  hyperparameters and steps; a frozen report.
- ``to_dcp(source, out_dir)``: any of those sources, or a fairseq/metaseq shard set (see
  :mod:`fsdp_optim.fairseq` for consolidating and resharding those), written as a PyTorch DCP checkpoint.
- Trust (docs/threat-model.md): ``register_elementwise_optimizer`` declares a custom optimizer elementwise
  (others are refused with ``NotElementwiseError``); writers lock their output (``OutputLockedError``) and
  refuse directories holding what is not theirs (``ForeignOutputError``, unless ``overwrite=True``).
- Object storage and any fsspec filesystem: every path above may be a URL (``s3://bucket/run/step-100``, ``gs://``,
  ``memory://``...); ``open_store(url, deadline_s=..., **storage_options)`` gives a store to pass instead where
  credentials, an endpoint or how long a failing store is retried (60 s by default, ``FSDP_OPTIM_STORE_DEADLINE_S``)
  come from code rather than the environment (docs/storage.md). A backend of one's own is one ``ObjectBackend``
  subclass of eight methods, passed as a path or registered for a URL scheme with ``register_backend``
  (docs/backends.md); ``Location`` is the interface every backend is, and ``StoreUnavailable``,
  ``ConcurrentCommitError``, ``CommitOutcomeUnknown`` its errors.
- ``host_execution()`` (or ``enable_host_execution()`` / ``disable_host_execution()``): a reversible switch
  that runs fairscale's own ``FullyShardedDataParallel`` on CPU with gloo.

Names are imported on first use (PEP 562): ``import fsdp_optim`` loads neither torch nor fairscale, the
offline functions (``consolidate``, ``reshard``, ``from_fairscale``, ...) load torch but not fairscale or
the collectives module, and only the in-job functions and the FSDP class bring those in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AsyncSave",
    "CheckpointManager",
    "CommitOutcomeUnknown",
    "ConcurrentCommitError",
    "DataPosition",
    "FORMAT_VERSION",
    "ForeignOutputError",
    "FullyShardedDataParallel",
    "Location",
    "NotElementwiseError",
    "ObjectBackend",
    "OutputLockedError",
    "ResumableSampler",
    "ResumeReport",
    "StoreUnavailable",
    "StoredObject",
    "async_save_checkpoint",
    "async_save_sharded_optim_state",
    "consolidate",
    "diff",
    "disable_host_execution",
    "enable_host_execution",
    "from_fairscale",
    "gather_full_optim_state_dict",
    "get_shard_from_optim_state_dict",
    "host_execution",
    "load_checkpoint",
    "load_full_state",
    "load_sharded_optim_state",
    "name_optimizer_state",
    "open_store",
    "register_backend",
    "register_elementwise_optimizer",
    "reshard",
    "sample_generator",
    "sample_seed",
    "save_checkpoint",
    "save_layout",
    "save_sharded_optim_state",
    "scatter_full_optim_state",
    "to_dcp",
    "to_named",
    "to_safetensors",
    "verify",
]
__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_HOME = {
    "AsyncSave": "job.async_save",
    "CheckpointManager": "job.manager",
    "CommitOutcomeUnknown": "disk.errors",
    "ConcurrentCommitError": "disk.errors",
    "DataPosition": "core.data_position",
    "ResumeReport": "core.data_position",
    "ResumableSampler": "job.sampler",
    "sample_generator": "core.sample_random",
    "sample_seed": "core.sample_random",
    "Location": "disk.location",
    "ObjectBackend": "disk.backend",
    "StoreUnavailable": "disk.errors",
    "StoredObject": "disk.byte_io",
    "register_backend": "disk.locations",
    "FORMAT_VERSION": "formats.fullstate",
    "ForeignOutputError": "disk.save",
    "NotElementwiseError": "core.elementwise",
    "OutputLockedError": "disk.locks",
    "register_elementwise_optimizer": "core.elementwise",
    "async_save_checkpoint": "job.whole_save",
    "async_save_sharded_optim_state": "job.async_save",
    "FullyShardedDataParallel": "job.fsdp",
    "consolidate": "offline.operations",
    "diff": "offline.diff",
    "disable_host_execution": "job.host",
    "enable_host_execution": "job.host",
    "from_fairscale": "formats.fairscale",
    "gather_full_optim_state_dict": "job.api",
    "get_shard_from_optim_state_dict": "job.api",
    "host_execution": "job.host",
    "load_checkpoint": "job.whole_load",
    "load_full_state": "offline.named",
    "load_sharded_optim_state": "job.sharded",
    "name_optimizer_state": "formats.plain",
    "open_store": "disk.locations",
    "reshard": "offline.operations",
    "save_checkpoint": "job.whole_save",
    "save_layout": "job.sharded",
    "save_sharded_optim_state": "job.sharded",
    "scatter_full_optim_state": "job.sharded",
    "to_dcp": "offline.export",
    "to_named": "formats.fairscale",
    "to_safetensors": "offline.named",
    "verify": "offline.verify",
}
assert sorted(_HOME) == sorted(__all__), "every public name needs a home module"


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'fsdp_optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # type checkers and IDEs see the real names
    from fsdp_optim.core.data_position import DataPosition, ResumeReport
    from fsdp_optim.core.elementwise import NotElementwiseError, register_elementwise_optimizer
    from fsdp_optim.core.sample_random import sample_generator, sample_seed
    from fsdp_optim.disk.backend import ObjectBackend
    from fsdp_optim.disk.byte_io import StoredObject
    from fsdp_optim.disk.errors import CommitOutcomeUnknown, ConcurrentCommitError, StoreUnavailable
    from fsdp_optim.disk.location import Location
    from fsdp_optim.disk.locations import open_store, register_backend
    from fsdp_optim.disk.locks import OutputLockedError
    from fsdp_optim.disk.save import ForeignOutputError
    from fsdp_optim.formats.fairscale import from_fairscale, to_named
    from fsdp_optim.formats.fullstate import FORMAT_VERSION
    from fsdp_optim.formats.plain import name_optimizer_state
    from fsdp_optim.job.api import gather_full_optim_state_dict, get_shard_from_optim_state_dict
    from fsdp_optim.job.async_save import AsyncSave, async_save_sharded_optim_state
    from fsdp_optim.job.fsdp import FullyShardedDataParallel
    from fsdp_optim.job.host import disable_host_execution, enable_host_execution, host_execution
    from fsdp_optim.job.manager import CheckpointManager
    from fsdp_optim.job.sampler import ResumableSampler
    from fsdp_optim.job.sharded import (
        load_sharded_optim_state,
        save_layout,
        save_sharded_optim_state,
        scatter_full_optim_state,
    )
    from fsdp_optim.job.whole_load import load_checkpoint
    from fsdp_optim.job.whole_save import async_save_checkpoint, save_checkpoint
    from fsdp_optim.offline.diff import diff
    from fsdp_optim.offline.export import to_dcp
    from fsdp_optim.offline.named import load_full_state, to_safetensors
    from fsdp_optim.offline.operations import consolidate, reshard
    from fsdp_optim.offline.verify import verify
