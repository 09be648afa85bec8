"""fsdp_optim: portable optimizer state, and the whole training state, for fairscale's FullyShardedDataParallel.

- In a job: ``gather_full_optim_state_dict`` / ``get_shard_from_optim_state_dict`` for any fairscale FSDP root;
  ``save_checkpoint`` / ``load_checkpoint`` (weights, buffers, optimizer state, ``extra``, the data position; any
  world size and nesting), ``async_save_checkpoint``, ``CheckpointManager``, ``ResumableSampler``,
  ``sample_generator``; the optimizer alone: ``save_sharded_optim_state``, ``load_sharded_optim_state``,
  ``scatter_full_optim_state``; ``host_execution()``: fairscale's own FSDP on CPU with gloo.
- With no process group: ``consolidate``, ``reshard``, ``verify``, ``diff``, ``to_dcp``, ``to_safetensors``,
  ``load_full_state``, ``from_fairscale``, ``to_named``, ``name_optimizer_state`` (and :mod:`fsdp_optim.fairseq`).
- Every path may be a URL or an ``open_store(...)`` store; ``ObjectBackend`` / ``register_backend`` add one
  (docs/storage.md, docs/backends.md). Trust and its errors: docs/threat-model.md.

docs/api.md documents every name of ``__all__``. Names are imported on first use (PEP 562): ``import fsdp_optim``
loads neither torch nor fairscale, the offline functions load torch but not fairscale or the collectives module, and
only the in-job functions and the FSDP class bring those in.
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

# The submodule that defines each public name.
_HOME = {
    name: home
    for home, names in {
        "core.data_position": ("DataPosition", "ResumeReport", "sample_generator", "sample_seed"),
        "core.elementwise": ("NotElementwiseError", "register_elementwise_optimizer"),
        "disk.backend": ("ObjectBackend",),
        "disk.byte_io": ("StoredObject",),
        "disk.errors": ("CommitOutcomeUnknown", "ConcurrentCommitError", "StoreUnavailable"),
        "disk.location": ("Location",),
        "disk.locations": ("open_store", "register_backend"),
        "disk.locks": ("OutputLockedError",),
        "disk.save": ("ForeignOutputError",),
        "formats.fairscale": ("from_fairscale", "to_named"),
        "formats.fullstate": ("FORMAT_VERSION",),
        "formats.plain": ("name_optimizer_state",),
        "job.api": ("gather_full_optim_state_dict", "get_shard_from_optim_state_dict"),
        "job.async_save": ("AsyncSave", "async_save_sharded_optim_state"),
        "job.fsdp": ("FullyShardedDataParallel",),
        "job.host": ("disable_host_execution", "enable_host_execution", "host_execution"),
        "job.manager": ("CheckpointManager",),
        "job.sampler": ("ResumableSampler",),
        "job.sharded": ("load_sharded_optim_state", "save_layout", "save_sharded_optim_state",
                        "scatter_full_optim_state"),
        "job.whole_load": ("load_checkpoint",),
        "job.whole_save": ("async_save_checkpoint", "save_checkpoint"),
        "offline.diff": ("diff",),
        "offline.export": ("to_dcp",),
        "offline.named": ("load_full_state", "to_safetensors"),
        "offline.operations": ("consolidate", "reshard"),
        "offline.verify": ("verify",),
    }.items()
    for name in names
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
    from fsdp_optim.core.data_position import DataPosition, ResumeReport, sample_generator, sample_seed
    from fsdp_optim.core.elementwise import NotElementwiseError, register_elementwise_optimizer
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
