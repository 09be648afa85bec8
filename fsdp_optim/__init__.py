"""fsdp_optim: portable optimizer state for fairscale's FullyShardedDataParallel.

- ``FullyShardedDataParallel``: fairscale's FSDP, runnable on CPU/gloo, with
  ``gather_full_optim_state_dict(optim)`` and ``get_shard_from_optim_state_dict(full)``.
- ``FORMAT_VERSION``: version of the full dict format written under the ``"fsdp_optim"`` key.
"""

from .fsdp import FullyShardedDataParallel
from .fullstate import FORMAT_VERSION

__all__ = ["FORMAT_VERSION", "FullyShardedDataParallel"]
__version__ = "0.1.0"
