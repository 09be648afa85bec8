"""Where loaded state lands, one rule on every device: the device never holds the state twice past the load.
Parameters and buffers land in the live tensors, in place (FSDP's flat parameters must keep their storage). The
optimizer's state lands in its live tensors where the loaded bytes cross devices (host tensors into GPU ones, through
the stager's pinned ring, :func:`fsdp_optim.job.stager.upload`, never through pageable memory); a loaded tensor
already in memory of its own on its parameter's device becomes the state as it is (a copy would cost and save
nothing). A load at the saved layout through a GPU's ring reads straight into the live tensors
(:func:`live_destination`), so there nothing is copied at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp_optim.core.records import WEIGHTS_KEY
from fsdp_optim.job.ring_load import Destination
from fsdp_optim.job.stager import check_pairs, upload
from fsdp_optim.job.staging import before_change

__all__ = ["into_live", "live_destination", "optimizer_state_on_device"]


def into_live(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each checked tensor into its live tensor (``(live, checked)``): on the device, through the pinned ring or
    directly. A floating-point tensor of another dtype is cast first; any other difference of dtype or shape is
    refused before a byte is written."""
    ready = [(live, t.to(live.dtype) if _castable(t, live) else t) for live, t in pairs if not _same(live, t)]
    check_pairs(ready)  # all or nothing: the device-side pairs too, before the first of them is copied
    on_device = [(live, t) for live, t in ready if live.is_cuda and t.device == live.device]
    with torch.no_grad():
        for live, t in on_device:
            live.copy_(t)
    upload([(live, t) for live, t in ready if not (live.is_cuda and t.device == live.device)])


def _same(live: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` is ``live``'s own memory (a load read it there: nothing to copy)."""
    same_place = live.device == t.device and live.data_ptr() == t.data_ptr()
    return same_place and live.shape == t.shape and live.dtype == t.dtype


def live_destination(params: Sequence[torch.Tensor], optim: torch.optim.Optimizer | None) -> Destination:
    """Where a load at the saved layout reads each shard (:meth:`fsdp_optim.job.ring_load.Verified.land`): the live
    tensor itself (the parameter's data, the optimizer's own state tensor) when it fits (numel, dtype, device,
    contiguous); else a new tensor (an optimizer that has not stepped yet: it becomes its state)."""

    def destination(flat: int, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        param = params[flat]
        state = optim.state.get(param, {}) if optim is not None else {}
        live = param.data if key == WEIGHTS_KEY else state.get(key)
        if (torch.is_tensor(live) and live.numel() == numel and live.dtype == dtype and live.device == device
                and live.is_contiguous()):  # fmt: skip
            return live.detach().view(-1)
        return torch.empty(numel, dtype=dtype, device=device)

    return destination


def _castable(host: torch.Tensor, live: torch.Tensor) -> bool:
    return host.dtype != live.dtype and host.is_floating_point() and live.is_floating_point()


def optimizer_state_on_device(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (``{"state": {id: {key: tensor or value}}, "param_groups": [...]}``, as
    ``optim.load_state_dict`` takes it) with every state tensor where the module docstring's rule puts it, cast to
    the dtype ``load_state_dict`` would cast it to (``step`` as it is). A tensor already on its parameter's device
    becomes the state: a copy into the live tensor would lower no peak, since ``load_state_dict`` frees the live
    tensors. An async save still copying ``optim``'s state is waited for first (its pre-hook on ``load_state_dict``
    would come too late)."""
    before_change(optim)
    params = _params_by_id(optim, state_dict)
    state: dict[Any, dict[str, Any]] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for pid, entries in state_dict["state"].items():
        param = params[pid]
        live = optim.state.get(param, {})
        state[pid] = dict(entries)
        for key, value in entries.items():
            if key == "step" or not torch.is_tensor(value):
                continue
            dtype = param.dtype if param.is_floating_point() else value.dtype
            target = live.get(key)
            fits = _fits(target, value, dtype, param.device)
            if value.device == param.device:  # memory of its own where it belongs (or the live tensor's own)
                state[pid][key] = target if fits and _same(target, value) else value.to(dtype)
                continue
            if not fits:
                target = torch.empty(value.shape, dtype=dtype, device=param.device)
            pairs.append((target, value.to(dtype)))  # as load_state_dict casts it (an integer one too)
            state[pid][key] = target
    into_live(pairs)
    return {**state_dict, "state": state}


def _fits(target: Any, value: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    return (torch.is_tensor(target) and target.shape == value.shape and target.dtype == dtype
            and target.device == device and target.is_contiguous())  # fmt: skip


def _params_by_id(optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> dict[Any, torch.Tensor]:
    """``{saved param id: live parameter}``, matched as ``load_state_dict`` matches them."""
    return {
        pid: param
        for saved, group in zip(state_dict["param_groups"], optim.param_groups, strict=True)
        for pid, param in zip(saved["params"], group["params"], strict=True)
    }
