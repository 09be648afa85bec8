"""The benchmark models, their FSDP wrappings (fairscale at two nestings, FSDP1, FSDP2), and the training steps that give Adam real state.

A model is a residual MLP stack: ``inp`` (d x d), ``layers`` blocks of LayerNorm + d -> 4d -> d, ``out``
(d x d). Every block is its own FSDP unit; ``inp``/``out`` stay in the root unit (nested FSDP).
Sizes: 8 d^2 + 7 d per block, plus 2 (d^2 + d).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# name -> (width d, blocks)
PRESETS: dict[str, tuple[int, int]] = {
    "1M": (128, 6),
    "5M": (256, 8),
    "25M": (512, 12),
    "100M": (1024, 12),
    "400M": (2048, 12),
    "1B": (2048, 30),
}
BATCH = 8  # rows per rank per step
LR = 1e-3


@dataclass(frozen=True)
class ModelSpec:
    name: str
    width: int
    layers: int

    @property
    def numel(self) -> int:
        d = self.width
        return self.layers * (8 * d * d + 7 * d) + 2 * (d * d + d)


def parse_model(text: str) -> ModelSpec:
    """``"25M"`` (a preset) or ``"768x16"`` (width x blocks)."""
    if text in PRESETS:
        return ModelSpec(text, *PRESETS[text])
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise ValueError(f"model: expected one of {sorted(PRESETS)} or WIDTHxBLOCKS like 768x16, found {text!r}")
    width, layers = int(match[1]), int(match[2])
    spec = ModelSpec("", width, layers)
    return ModelSpec(f"{text} ({spec.numel / 1e6:.0f}M)", width, layers)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.inp = nn.Linear(spec.width, spec.width)
        self.layers = nn.ModuleList(Block(spec.width) for _ in range(spec.layers))
        self.out = nn.Linear(spec.width, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x)


def build(spec: ModelSpec, device: torch.device) -> Stack:
    """The same initial weights on every rank."""
    torch.manual_seed(0)
    with torch.device(device):
        return Stack(spec)


def wrap_fairscale(spec: ModelSpec, device: torch.device) -> nn.Module:
    """fsdp_optim's FSDP (fairscale's, runnable on CPU): one unit per block, then the root."""
    from fsdp_optim import FullyShardedDataParallel as FSDP

    model = build(spec, device)
    for i, block in enumerate(model.layers):
        model.layers[i] = FSDP(block, flatten_parameters=True)
    return FSDP(model, flatten_parameters=True)


def wrap_fairscale_linears(spec: ModelSpec, device: torch.device) -> nn.Module:
    """fsdp_optim's FSDP at another nesting: one unit per Linear inside each block (``fc1``, ``fc2``), then the
    root holding the rest (``inp``, ``out``, every LayerNorm): what a checkpoint of ``wrap_fairscale`` is
    re-cut into when it loads at another nesting."""
    from fsdp_optim import FullyShardedDataParallel as FSDP

    model = build(spec, device)
    for block in model.layers:
        block.fc1 = FSDP(block.fc1, flatten_parameters=True)  # type: ignore[assignment]
        block.fc2 = FSDP(block.fc2, flatten_parameters=True)  # type: ignore[assignment]
    return FSDP(model, flatten_parameters=True)


def wrap_fsdp1(spec: ModelSpec, device: torch.device) -> nn.Module:
    """PyTorch FSDP1: one unit per block through the auto-wrap policy, then the root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP1(build(spec, device), device_id=device, auto_wrap_policy=ModuleWrapPolicy({Block}))


def wrap_fsdp2(spec: ModelSpec, device: torch.device) -> nn.Module:
    """PyTorch FSDP2 (``fully_shard``) on a 1-D mesh of the device type: each block, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = build(spec, device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, spec: ModelSpec, steps: int, rank: int, device: torch.device) -> torch.optim.Optimizer:
    """``steps`` Adam steps on this rank's own random batches; returns the optimizer."""
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(BATCH, spec.width, generator=g).to(device)
        y = torch.randn(BATCH, spec.width, generator=g).to(device)
        optim.zero_grad()
        F.mse_loss(model(x), y).backward()
        optim.step()
    return optim
