"""Loads into a fresh optimizer and zeroed weights, and the checks that the load put the saved state back.

Before each timed load (untimed): the target model's parameters are zeroed and a fresh Adam is built on them,
so a load that skipped anything shows in the check; the first call is then compared, on every rank, with the
state the job saved (same world size) or with a reference written by the job that saved (another world size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import models
from ..ckpt.common import Probes, difference, local, wrong
from ..measure import Method


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    """This rank's parameter shards (a DTensor's local shard), copied: what a same-W load must restore."""
    return [local(p.detach()).clone() for p in model.parameters()]


def same_as(model: nn.Module, weights: list[torch.Tensor], optim: torch.optim.Optimizer) -> Callable[[Any], str]:
    """A check of a same-W load: the model's shards equal ``weights``, the loaded optimizer equals ``optim``."""

    def check(loaded: torch.optim.Optimizer) -> str:
        found = [local(p.detach()) for p in model.parameters()]
        text = difference(found, weights, "weights") or difference(loaded.state_dict(), optim.state_dict(), "optim")
        return wrong(text)

    return check


def load_method(name: str, model: nn.Module, load: Callable[[torch.optim.Optimizer], None], check: Callable[[Any], str], probes: Probes) -> Method:
    """``load(fresh_adam)`` into ``model`` after zeroing its parameters; returns the loaded optimizer."""
    fresh: list[torch.optim.Optimizer] = []

    def prepare() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        fresh[:] = [torch.optim.Adam(model.parameters(), lr=models.LR)]

    def call() -> torch.optim.Optimizer:
        load(fresh[0])
        return fresh[0]

    return probes.wrap(name, Method(call, prepare=prepare, finish=fresh.clear), check)
