"""fsdp_optim: portable optimizer state for fairscale's FullyShardedDataParallel.

- ``gather_full_optim_state_dict(fsdp, optim)`` and ``get_shard_from_optim_state_dict(fsdp, full)`` for any
  fairscale FSDP root (fairscale's own class, a subclass such as fairseq's, or ours): no re-wrapping.
- ``FullyShardedDataParallel``: fairscale's FSDP, runnable on CPU/gloo, with the same two as methods.
- ``FORMAT_VERSION``: version of the full dict format written under the ``"fsdp_optim"`` key.
- Checkpoints on disk: ``save_sharded_optim_state`` / ``load_sharded_optim_state`` in a job (every rank
  writes and reads its own file; resharding on load), ``scatter_full_optim_state`` (one rank reads a full
  dict, each rank receives its shard), and with no process group ``consolidate`` / ``reshard``;
  ``save_layout``, ``from_fairscale`` (fairscale's own format) and ``to_named`` (FSDP2 / DCP).
- ``host_execution()`` (or ``enable_host_execution()`` / ``disable_host_execution()``): a reversible switch
  that runs fairscale's own ``FullyShardedDataParallel`` on CPU with gloo.
"""

from ._host import disable_host_execution, enable_host_execution, host_execution
from .api import gather_full_optim_state_dict, get_shard_from_optim_state_dict
from .fsdp import FullyShardedDataParallel
from .fullstate import FORMAT_VERSION
from .interop import from_fairscale, to_named
from .offline import consolidate, reshard
from .sharded import load_sharded_optim_state, save_layout, save_sharded_optim_state, scatter_full_optim_state

__all__ = [
    "FORMAT_VERSION",
    "FullyShardedDataParallel",
    "consolidate",
    "disable_host_execution",
    "enable_host_execution",
    "from_fairscale",
    "gather_full_optim_state_dict",
    "get_shard_from_optim_state_dict",
    "host_execution",
    "load_sharded_optim_state",
    "reshard",
    "save_layout",
    "save_sharded_optim_state",
    "scatter_full_optim_state",
    "to_named",
]
__version__ = "0.1.0"
