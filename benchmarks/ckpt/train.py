"""The number users feel: a short training run that checkpoints every N steps, against the same run without.

Each variant is one ``Method`` whose call is a whole run of ``(checkpoints + 1) * every`` Adam steps on
batches drawn before timing, saving after steps ``every, 2 * every, ... checkpoints * every``, so the last
save still has ``every`` steps to overlap with. An asynchronous save first waits for the previous one
(a job never has two in flight), and the run ends only when the last checkpoint is durable: deferred work
is counted, not dropped. ``measure`` interleaves the variants round-robin and repeats them, so the
overhead of a checkpoint is taken per round against that round's run without checkpoints, on the same
model (ours: fairscale FSDP; DCP: FSDP2), then the median over rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_optim

from .. import models
from ..measure import Method
from . import dcp as ckpt_dcp

VARIANTS = ("train_ours_none", "train_ours_sync", "train_ours_async", "train_dcp_none", "train_dcp_sync", "train_dcp_async")


@dataclass(frozen=True)
class TrainConfig:
    every: int  # steps between checkpoints
    checkpoints: int  # checkpoints per run
    repeats: int  # runs per variant (interleaved)

    @property
    def steps(self) -> int:
        return (self.checkpoints + 1) * self.every


def _batches(spec: models.ModelSpec, steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2000 + rank)
    return [
        (torch.randn(models.BATCH, spec.width, generator=g), torch.randn(models.BATCH, spec.width, generator=g))
        for _ in range(steps)
    ]


def _run(
    cfg: TrainConfig,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    save: Callable[[], Any] | None,
    wait: Callable[[Any], Any] | None,
) -> None:
    pending = None
    for step, (x, y) in enumerate(batches):
        optim.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optim.step()
        if save is not None and (step + 1) % cfg.every == 0 and (step + 1) // cfg.every <= cfg.checkpoints:
            if pending is not None and wait is not None:
                wait(pending)
            pending = save()
    if pending is not None and wait is not None:
        wait(pending)
    optim.zero_grad(set_to_none=True)  # DCP's loader initialises a fresh optimizer only when grads are None


def methods(
    cfg: TrainConfig,
    spec: models.ModelSpec,
    ours: tuple[nn.Module, torch.optim.Optimizer],
    fsdp2: tuple[nn.Module, torch.optim.Optimizer],
    *,
    work: Path,
    group: dist.ProcessGroup,
) -> dict[str, Method]:
    batches = _batches(spec, cfg.steps, dist.get_rank())

    def variant(
        setup: tuple[nn.Module, torch.optim.Optimizer],
        save: Callable[[nn.Module, torch.optim.Optimizer], Any] | None,
        wait: Callable[[Any], Any] | None = None,
    ) -> Method:
        model, optim = setup
        bound = (lambda: save(model, optim)) if save is not None else None
        return Method(lambda: _run(cfg, model, optim, batches, bound, wait))

    out = {
        "train_ours_none": variant(ours, None),
        "train_ours_sync": variant(ours, lambda m, o: fsdp_optim.save_sharded_optim_state(m, o, work / "train-ours")),
    }
    out["train_ours_async"] = variant(
        ours, lambda m, o: fsdp_optim.async_save_sharded_optim_state(m, o, work / "train-ours-async"), lambda handle: handle.wait()
    )
    out["train_dcp_none"] = variant(fsdp2, None)
    out["train_dcp_sync"] = variant(fsdp2, lambda m, o: ckpt_dcp.save(m, o, work / "train-dcp"))
    out["train_dcp_async"] = variant(
        fsdp2, lambda m, o: ckpt_dcp.async_save(m, o, work / "train-dcp-async", group), lambda future: future.result()
    )
    return out
