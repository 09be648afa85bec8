"""The benchmark's two models, the same layers and optimizer: ours (fairscale FSDP, a unit per layer) and DCP's
(FSDP2 ``fully_shard`` per layer), each trained one step so that Adam's state exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP


@dataclass(frozen=True)
class Config:
    layers: int
    dim: int
    batch: int
    device: torch.device
    directory: str  # where checkpoints are written (tmpfs)
    repeats: int

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def _layers(config: Config) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(config.dim, config.dim) for _ in range(config.layers))).to(config.device)


def step(model: nn.Module, optim: torch.optim.Optimizer, config: Config) -> None:
    """One training step on a fixed random batch."""
    x = torch.randn(config.batch, config.dim, device=config.device)
    optim.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optim.step()


def ours(config: Config, group: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Our model; on ``group`` (a process group) for its collectives and reduce-scatter, else on the default one."""
    kwargs = {} if group is None else {"process_group": group, "process_group_reduce_scatter": group}
    net = _layers(config)
    for i in range(len(net)):
        net[i] = FSDP(net[i], **kwargs)
    model = FSDP(net, **kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    step(model, optim, config)
    return model, optim


def dcp_model(config: Config) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = _layers(config)
    mesh = init_device_mesh(config.device.type, (1,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = torch.optim.Adam(net.parameters(), lr=1e-4)
    step(net, optim, config)
    return net, optim


def sync(config: Config) -> None:
    if config.on_gpu:
        torch.cuda.synchronize()
