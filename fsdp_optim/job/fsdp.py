"""``fsdp_optim.FullyShardedDataParallel``: fairscale's FSDP that runs on CPU and has portable optimizer state, and
the constructor options that cannot work, refused before any collective (pure policy: which combinations fairscale
0.4.13 cannot run, each error naming its option; what fairscale has already taken over is read in
:mod:`fsdp_optim.job.root`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fairscale.nn import FullyShardedDataParallel as _FairscaleFSDP

from fsdp_optim.job import api
from fsdp_optim.job import host as _host
from fsdp_optim.job.host_fixes import quiet
from fsdp_optim.job.root import unsharded_parameters

__all__ = [
    "ComputePlacement", "FullyShardedDataParallel", "check_forward_inputs", "check_options", "computes_on_host",
    "placement",
]  # fmt: skip

_FAIRSCALE_PARAMS = inspect.signature(_FairscaleFSDP.__init__)


class FullyShardedDataParallel(_FairscaleFSDP):
    """fairscale's ``FullyShardedDataParallel`` with the same constructor, plus:

    - it runs on the CPU, on any machine: with the module on CPU and a gloo process group, ``compute_device``
      defaults to the CPU and fairscale's stream calls become no-ops. Constructing one that computes on the CPU
      (:func:`fsdp_optim.job.fsdp.computes_on_host`) enables :func:`fsdp_optim.host_execution` for the rest of the
      process (see :mod:`fsdp_optim.job.host`); one that computes on a GPU leaves fairscale as it is;
    - options that cannot work are refused at construction with a ``ValueError`` naming the option
      (``compute_dtype`` differing from the parameters' dtype without ``mixed_precision`` or CPU
      offload; a non-CPU ``compute_device`` / ``state_dict_device`` on a machine without CUDA), and at the first
      forward a float32 input that fairscale would cast to float16 under ``mixed_precision`` with a
      ``compute_dtype`` such as bfloat16;
    - :meth:`gather_full_optim_state_dict` and :meth:`get_shard_from_optim_state_dict` move optimizer
      state between this sharded form and one full, world-size-independent dict.
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
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
        """fairscale's forward, after :func:`check_forward_inputs` at a mixed-precision root in another dtype than
        float16."""
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


def check_options(module: torch.nn.Module, options: dict[str, Any]) -> None:
    """Refuse, before any collective, the constructor options that cannot work; each error names its option.

    ``options`` are the arguments given to fairscale's constructor, by name (defaults left out).

    - ``compute_dtype`` other than the parameters' dtype needs ``mixed_precision=True``: only then does
      fairscale keep the gradients and full-precision gathers in the parameters' dtype. Without it,
      ``state_dict()`` and ``summon_full_params()`` all-gather the parameters' dtype into a
      ``compute_dtype`` buffer, which gloo and NCCL both reject (and so does the forward pass, unless
      ``move_params_to_cpu``), and with ``move_params_to_cpu`` but not ``move_grads_to_cpu`` backward
      assigns ``compute_dtype`` gradients to the parameters. This holds on any machine.
    - Without CUDA, ``compute_device`` and ``state_dict_device`` must be the CPU.
    """
    compute_dtype = options.get("compute_dtype")
    if compute_dtype is not None and not options.get("mixed_precision"):
        dtypes = sorted({str(p.dtype) for p in unsharded_parameters(module)})
        if dtypes and dtypes != [str(compute_dtype)]:
            found = ", ".join(dtypes)
            raise ValueError(
                f"compute_dtype={compute_dtype} differs from the parameters' dtype ({found}), which fairscale "
                f"supports only with mixed_precision=True: without it state_dict() all-gathers {found} shards "
                f"into a {compute_dtype} buffer, which the process group rejects. Pass mixed_precision=True "
                f"to compute in {compute_dtype}, or leave compute_dtype unset"
            )
    if not torch.cuda.is_available():  # a fact about the machine: no GPU to compute or keep state on
        for name in ("compute_device", "state_dict_device"):
            device = options.get(name)
            if device is not None and torch.device(device).type != "cpu":
                raise ValueError(
                    f"{name}={device!r}: this machine has no CUDA, so FSDP runs on the CPU; pass "
                    f"{name}=torch.device('cpu') or leave it unset"
                )


@dataclass(frozen=True)
class ComputePlacement:
    """What decides where fairscale computes one instance: the machine, and the constructor's inputs."""

    cuda_available: bool
    compute_device: torch.device | None  # the constructor's ``compute_device``, None when not given
    offload: bool  # ``move_params_to_cpu`` or its old name ``cpu_offload``: shards kept on the CPU, computed elsewhere
    param_devices: frozenset[str]  # device types of the parameters it takes (see :func:`placement`)


def computes_on_host(where: ComputePlacement) -> bool:
    """Whether an instance computes on the CPU (fairscale's CPU path: :mod:`fsdp_optim.job.host`). Pure.

    fairscale 0.4.13 computes on ``compute_device or _get_default_cuda_device(module)``: the first parameter's device
    when it is a GPU, else ``torch.device("cuda")``. So, in order:

    - an explicit ``compute_device`` decides;
    - parameters on a GPU (or any non-CPU device) compute there, as in fairscale;
    - CPU parameters with ``move_params_to_cpu`` (CPU offload) compute on the default GPU when the machine has one,
      as in fairscale (which requires offloaded parameters to start on the CPU), else on the CPU;
    - CPU parameters without offload compute on the CPU, on any machine: fairscale would put its full-parameter
      buffers on the GPU while the shards stay on the CPU, which no process group can all-gather; a CPU model under
      gloo works on a GPU machine too;
    - a module without any parameter goes where fairscale's default puts it: the GPU when there is one.
    """
    if where.compute_device is not None:
        return where.compute_device.type == "cpu"
    if not where.param_devices:
        return not where.cuda_available
    if where.param_devices - {"cpu"}:
        return False
    return not (where.offload and where.cuda_available)


def placement(module: torch.nn.Module, options: dict[str, Any]) -> ComputePlacement:
    """The :class:`ComputePlacement` of ``module`` wrapped with ``options``, on this machine: of the module's own
    parameters, or of those nested instances took over when it has none (a root over wrapped layers)."""
    devices = {p.device.type for p in unsharded_parameters(module)} or {p.device.type for p in module.parameters()}
    compute = options.get("compute_device")
    return ComputePlacement(
        cuda_available=torch.cuda.is_available(),
        compute_device=torch.device(compute) if compute is not None else None,
        offload=bool(options.get("move_params_to_cpu") or options.get("cpu_offload")),
        param_devices=frozenset(devices),
    )


def check_forward_inputs(compute_dtype: torch.dtype, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a float32 tensor among a mixed-precision root's forward inputs (``args``, ``kwargs``, nested in tuples,
    lists and dicts) when ``compute_dtype`` is not float16, outside ``torch.autocast``; the error names the input.

    fairscale 0.4.13's root casts every float32 input to float16 under ``mixed_precision``, whatever ``compute_dtype``
    is: with bfloat16 parameters the first layer then fails on "Half and BFloat16" (on any device). Inputs already in
    ``compute_dtype`` (fairseq's ``--bf16`` casts its batches), integer inputs (token ids) and autocast (which casts
    both sides) all work, so this is checked where the inputs are known: at the forward, not at construction.
    """
    stack: list[tuple[str, Any]] = [(f"args[{i}]", a) for i, a in enumerate(args)]
    stack += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    while stack:
        where, value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, Mapping):
            stack.extend((f"{where}[{k!r}]", v) for k, v in value.items())
        elif torch.is_tensor(value) and value.dtype == torch.float32 and not _autocast(value):
            short = str(compute_dtype).removeprefix("torch.")
            raise ValueError(
                f"forward: input {where} is float32, and under mixed_precision=True fairscale casts float32 inputs "
                f"to float16, not to compute_dtype={compute_dtype}: the first layer would mix float16 and {short}. "
                f"Pass the inputs in {short} ({where}.to({compute_dtype})), or run the forward under torch.autocast"
            )


def _autocast(tensor: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(tensor.device.type)
