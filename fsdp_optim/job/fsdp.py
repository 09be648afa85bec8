"""``fsdp_optim.FullyShardedDataParallel``: fairscale's FSDP that runs on CPU and has portable optimizer state.

Orchestration only: the layout comes from :mod:`fsdp_optim.core.layout`, the maths from
:mod:`fsdp_optim.core.flatten` and :mod:`fsdp_optim.formats.fullstate`, the bytes move through :mod:`.transport`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from fairscale.nn import FullyShardedDataParallel as _FairscaleFSDP

from fsdp_optim.job import api
from fsdp_optim.job import host as _host
from fsdp_optim.job.host_fixes import quiet
from fsdp_optim.job.options import check_forward_inputs, check_options, computes_on_host, placement

__all__ = ["FullyShardedDataParallel"]

_FAIRSCALE_PARAMS = inspect.signature(_FairscaleFSDP.__init__)


class FullyShardedDataParallel(_FairscaleFSDP):
    """fairscale's ``FullyShardedDataParallel`` with the same constructor, plus:

    - it runs on the CPU, on any machine: with the module on CPU and a gloo process group, ``compute_device``
      defaults to the CPU and fairscale's stream calls become no-ops. Constructing one that computes on the CPU
      (:func:`fsdp_optim.job.options.computes_on_host`: fairscale's own ``compute_device``; CPU parameters without
      CPU offload compute on the CPU on any machine, with ``move_params_to_cpu`` on the GPU when there is one)
      enables :func:`fsdp_optim.host_execution` for the rest of the process (see :mod:`fsdp_optim.job.host`);
      one that computes on a GPU leaves fairscale as it is;
    - options that cannot work are refused at construction with a ``ValueError`` naming the option
      (``compute_dtype`` differing from the parameters' dtype without ``mixed_precision`` or CPU
      offload; a non-CPU ``compute_device`` / ``state_dict_device`` on a machine without CUDA), and at the first
      forward a float32 input that fairscale would cast to float16 under ``mixed_precision`` with a
      ``compute_dtype`` such as bfloat16;
    - :meth:`gather_full_optim_state_dict` and :meth:`get_shard_from_optim_state_dict` move optimizer
      state between this sharded form and one full, world-size-independent dict.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        # Options that cannot work are refused here, naming the option, before any collective.
        options = _FAIRSCALE_PARAMS.bind_partial(None, module, *args, **kwargs).arguments
        check_options(module, options)
        if computes_on_host(placement(module, options)):  # where fairscale computes it, here
            # For the rest of the process (a model outlives any scope we could pick); idempotent.
            _host.enable_for_process()
        else:
            _host.note_cuda_root()
        with quiet():  # fairscale's first Tensor.storage() call warns of a deprecation; not the user's to fix
            super().__init__(module, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """fairscale's forward; first, at the root under mixed precision in another dtype than float16, a float32
        input is refused by name (fairscale would cast it to float16; see
        :func:`~fsdp_optim.job.options.check_forward_inputs`)."""
        if self.mixed_precision and self.compute_dtype != torch.float16 and self._is_root is not False:
            check_forward_inputs(self.compute_dtype, args, kwargs)
        return super().forward(*args, **kwargs)

    # -- optimizer state ---------------------------------------------------------------------------

    def gather_full_optim_state_dict(
        self,
        optim: torch.optim.Optimizer,
        *,
        recipient_rank: int | None = 0,
        transport: Literal["tensor", "object"] = "tensor",
    ) -> dict[str, Any] | None:
        """:func:`fsdp_optim.gather_full_optim_state_dict` on this (root) instance; see there."""
        return api.gather_full_optim_state_dict(self, optim, recipient_rank=recipient_rank, transport=transport)

    def get_shard_from_optim_state_dict(
        self,
        full_optim_state_dict: Mapping[str, Any] | str | os.PathLike[str],
        *,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """:func:`fsdp_optim.get_shard_from_optim_state_dict` on this (root) instance; see there."""
        return api.get_shard_from_optim_state_dict(self, full_optim_state_dict, optim=optim)
