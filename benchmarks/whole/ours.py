"""The whole-state checkpoint, as ``Method``s, through ``fsdp_optim``'s public API only.

- ``whole_save``: ``save_checkpoint(model, optim, dir)`` (weights, buffers, optimizer state; durable, manifest last);
- ``whole_async``: ``async_save_checkpoint(model, optim, dir)``; timed:
  the blocking call, recorded: the time until its handle's ``wait()`` returns (the checkpoint durable, committed);
- ``whole_load_same``: ``load_checkpoint(model, fresh_adam, dir)`` from this job's checkpoint;
- ``whole_load_other``: the same from a checkpoint a job of another world size saved, into the same model at
  another FSDP nesting (``models.wrap_fairscale_linears``: a unit per Linear instead of per block).

Checks: a same-W load must give back this job's live weight shards and optimizer state bit for bit (which
also checks ``whole_save``, whose checkpoint it reads); an other-W load must give the saving job's full
weights (``state_dict()``, a collective) and, cut for this rank, its full optimizer state
(``get_shard_from_optim_state_dict`` of the gathered dict the saving job wrote beside its checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import fsdp_optim

from ..ckpt.common import Probes, difference, wrong
from ..measure import Method
from .fresh import load_method, same_as, snapshot


def reference(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A collective: the full weights (every rank) and the full optimizer state (rank 0) the checks compare with."""
    return {"model": model.state_dict(), "optim": model.gather_full_optim_state_dict(optim)}  # type: ignore[operator]


def save_methods(model: nn.Module, optim: torch.optim.Optimizer, *, directory: Path, async_dir: Path, probes: Probes) -> dict[str, Method]:
    methods = {"whole_save": Method(lambda: fsdp_optim.save_checkpoint(model, optim, directory))}
    methods["whole_async"] = probes.wrap(
        "whole_async", Method(lambda: fsdp_optim.async_save_checkpoint(model, optim, async_dir)), durable=lambda handle: handle.wait()
    )
    return methods


def load_same(model: nn.Module, optim: torch.optim.Optimizer, *, directory: Path, probes: Probes) -> dict[str, Method]:
    load = lambda target: fsdp_optim.load_checkpoint(model, target, directory)  # noqa: E731
    return {"whole_load_same": load_method("whole_load_same", model, load, same_as(model, snapshot(model), optim), probes)}


def load_other(model: nn.Module, *, directory: Path, reference_file: Path, probes: Probes) -> dict[str, Method]:
    """Into ``model`` (another nesting, this job's world size) from a checkpoint saved at another world size."""

    def check(loaded: torch.optim.Optimizer) -> str:
        weights = model.state_dict()  # a collective, first: every rank reaches it
        ref = torch.load(reference_file, mmap=True, weights_only=False)
        expected = model.get_shard_from_optim_state_dict(ref["optim"], optim=loaded)  # type: ignore[operator]
        return wrong(difference(weights, ref["model"], "weights") or difference(loaded.state_dict(), expected, "optim"))

    load = lambda target: fsdp_optim.load_checkpoint(model, target, directory)  # noqa: E731
    return {"whole_load_other": load_method("whole_load_other", model, load, check, probes)}

