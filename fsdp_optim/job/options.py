"""The constructor options of ``fsdp_optim.FullyShardedDataParallel`` that cannot work, refused before any collective.

Pure policy: which combinations fairscale 0.4.13 cannot run, each error naming its option. What fairscale has
already taken over (parameters of nested instances) is read in :mod:`fsdp_optim.job.root`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fsdp_optim.job.root import unsharded_parameters

__all__ = ["check_forward_inputs", "check_options", "runs_on_host"]


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


def runs_on_host(module: torch.nn.Module, options: dict[str, Any]) -> bool:
    """Whether fairscale computes this instance on the CPU (fairscale's CPU path: :mod:`fsdp_optim.job.host`).

    Decided by where the model computes, never by whether the machine has CUDA (a CPU model under gloo on a GPU
    machine runs on the CPU): an explicit ``compute_device`` decides; else the parameters' device (those of nested
    instances for a root whose own were all taken by them); only a module without any parameter goes where fairscale
    would put it. So CPU offload
    onto a GPU (``move_params_to_cpu`` with parameters on the CPU) names its GPU: ``compute_device=torch.device(
    "cuda")``, as fairscale asks for it anyway (it checks the process group on that device). ``options`` as for
    :func:`check_options`.
    """
    compute = options.get("compute_device")
    if compute is not None:
        return torch.device(compute).type == "cpu"
    # Its own parameters; those that nested instances took over when it has none (a root over wrapped layers).
    devices = {p.device.type for p in unsharded_parameters(module)} or {p.device.type for p in module.parameters()}
    if not devices:  # no parameters at all: where fairscale would compute it (its default is the GPU)
        return not torch.cuda.is_available()
    return not devices - {"cpu"}


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
