"""PyTorch's answer, as ``Method``s: FSDP2 (``fully_shard``) with Distributed Checkpoint (DCP).

Optimizer state only, as ours: the state dict saved is ``{"optim": get_optimizer_state_dict(model,
optim)}`` (FQN keys, DTensor shards), and building it is part of every save's time, as it is of a user's.

- ``dcp_save``: ``dcp.save`` (default process group);
- ``dcp_async``: ``dcp.async_save`` on a gloo group of its own (as torchtitan does, so the background
  thread's collectives never interleave with training's), thread mode, default stager (a CPU copy).
  Timed: the blocking call; recorded: the time until ``.result()`` returns;
- ``dcp_load_same`` / ``dcp_load_other``: the documented recipe into a fresh Adam,
  ``get_optimizer_state_dict`` (which initialises the fresh optimizer's state with one zero-lr step),
  ``dcp.load``, ``set_optimizer_state_dict``; from this job's checkpoint and from another world size's;
- ``dcp_to_torch_save``: offline ``format_utils.dcp_to_torch_save`` (rank 0), then an fsync of its file.

Checks: a save is converted with ``dcp_to_torch_save`` and compared with the full state dict that
``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`` returned before timing; a load is
compared on every rank with the live optimizer (same world size) or with this rank's DTensor shards of
the other job's full state dict.

The whole state, ``whole_*``: ``{"model", "optimizer"}`` of ``get_state_dict(model, optim)``, saved (``dcp_save``,
and with an async directory ``dcp_async``) and loaded into zeroed weights and a fresh Adam (``dcp_load_same``:
``get_state_dict``, ``dcp.load``, ``set_state_dict``), which must give back the live shards and optimizer state
exactly; on a local directory or, through ``location``, DCP's ``FsspecWriter`` / ``FsspecReader`` on an object store.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ..measure import Method
from ..peak import fsync_path
from .common import Loads, Probes, difference, fresh_load_methods, measured_and_removed, reloads, wrong


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A collective: the full optimizer state dict on rank 0 (empty elsewhere), the checks' reference."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optim, options=options)


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"optim": get_optimizer_state_dict(model, optim)}


def save(model: nn.Module, optim: torch.optim.Optimizer, directory: Path) -> Any:
    return dcp.save(_state(model, optim), checkpoint_id=directory)


def async_save(model: nn.Module, optim: torch.optim.Optimizer, directory: Path, group: dist.ProcessGroup) -> Any:
    """A future; its ``result()`` returns once the checkpoint is written."""
    return dcp.async_save(_state(model, optim), checkpoint_id=directory, process_group=group)


def _converted_matches(directory: Path, reference: dict[str, Any] | None) -> str:
    """Rank 0: the DCP checkpoint in ``directory`` holds ``reference``'s state exactly ("" elsewhere)."""
    if dist.get_rank() != 0:
        return ""
    with tempfile.TemporaryDirectory(dir=directory.parent) as scratch:
        path = Path(scratch) / "full.pt"
        dcp_to_torch_save(directory, path)
        saved = torch.load(path, weights_only=False)
    return wrong(difference(saved["optim"]["state"], reference["state"], "optim/state"))  # type: ignore[index]


def save_methods(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    same_dir: Path,
    async_dir: Path,
    group: dist.ProcessGroup,
    reference: dict[str, Any] | None,
    probes: Probes,
) -> dict[str, Method]:
    return {
        "dcp_save": probes.wrap(
            "dcp_save", Method(lambda: save(model, optim, same_dir)), lambda _: _converted_matches(same_dir, reference)
        ),
        "dcp_async": probes.wrap(
            "dcp_async",
            Method(lambda: async_save(model, optim, async_dir, group)),
            lambda _: _converted_matches(async_dir, reference),
            durable=lambda future: future.result(),
        ),
    }


def _expected_shards(model: nn.Module, loaded: torch.optim.Optimizer, full: dict[str, Any]) -> dict[int, Any]:
    """This rank's part of a full FQN-keyed state, cut like ``loaded``'s DTensors (locally: no collective)."""
    from torch.distributed.tensor import distribute_tensor

    names = [name for name, _ in model.named_parameters()]
    expected: dict[int, Any] = {}
    for index, entry in loaded.state_dict()["state"].items():
        saved = full["state"][names[index]]
        expected[index] = {
            key: distribute_tensor(saved[key], value.device_mesh, value.placements, src_data_rank=None)
            if hasattr(value, "placements")
            else saved[key]
            for key, value in entry.items()
        }
    return expected


def load_methods(model: nn.Module, optim: torch.optim.Optimizer, where: Loads) -> dict[str, Method]:
    def load_into(target: torch.optim.Optimizer, directory: Path) -> None:
        state = _state(model, target)
        dcp.load(state, checkpoint_id=directory)
        set_optimizer_state_dict(model, target, optim_state_dict=state["optim"])

    def other_wrong(loaded: torch.optim.Optimizer, full: Any) -> str:
        return wrong(difference(loaded.state_dict()["state"], _expected_shards(model, loaded, full), "state"))

    return fresh_load_methods("dcp", model, optim, load_into, other_wrong, where)


def offline_methods(
    *, same_dir: Path, out_dir: Path, reference: dict[str, Any] | None, disk: dict[str, int]
) -> dict[str, Method]:
    rank = dist.get_rank()
    path = out_dir / "dcp-full.pt"

    def convert() -> Path | None:
        if rank != 0:
            return None
        dcp_to_torch_save(same_dir, path)
        fsync_path(path)
        return path

    def check(_: Any) -> str:
        saved = torch.load(path, weights_only=False)
        return wrong(difference(saved["optim"]["state"], reference["state"], "optim/state"))  # type: ignore[index]

    return {"dcp_to_torch_save": Method(convert, check=check, finish=measured_and_removed(disk, "dcp_to_torch_save", path))}


def _whole_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optim)
    return {"model": model_state, "optimizer": optim_state}


def location(directory: Path | None = None, *, url: str = "", options: dict[str, Any] | None = None) -> Callable[[bool], dict[str, Any]]:
    """Where DCP saves and loads: ``location(write)`` gives ``dcp.save`` / ``dcp.load``'s keywords, a local
    ``directory`` or, with ``url``, a fresh ``FsspecWriter`` / ``FsspecReader`` (with ``options``) per call."""
    if directory is not None:
        return lambda write: {"checkpoint_id": directory}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return lambda write: {"storage_writer": FsspecWriter(url, **(options or {}))} if write else {"storage_reader": FsspecReader(url, **(options or {}))}


def whole_save_methods(model: nn.Module, optim: torch.optim.Optimizer, *, where: Callable[[bool], dict[str, Any]], probes: Probes,
                       async_dir: Path | None = None, group: dist.ProcessGroup | None = None) -> dict[str, Method]:  # fmt: skip
    """``dcp_save`` (and, with ``async_dir``, ``dcp_async`` on ``group``)."""
    methods = {"dcp_save": Method(lambda: dcp.save(_whole_state(model, optim), **where(True)))}
    if async_dir is not None:
        call = Method(lambda: dcp.async_save(_whole_state(model, optim), checkpoint_id=async_dir, process_group=group))
        methods["dcp_async"] = probes.wrap("dcp_async", call, durable=lambda future: future.result())
    return methods


def whole_load_same(model: nn.Module, optim: torch.optim.Optimizer, *, where: Callable[[bool], dict[str, Any]], probes: Probes) -> dict[str, Method]:
    def load(target: torch.optim.Optimizer) -> None:
        state = _whole_state(model, target)
        dcp.load(state, **where(False))
        set_state_dict(model, target, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return {"dcp_load_same": reloads("dcp_load_same", model, optim, load, probes)}
