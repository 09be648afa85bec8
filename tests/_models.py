"""A small model with every case the package must handle, its wrappings, optimizers and data.

``Net`` has: a two-level nest (``block2`` holds ``block2.inner``), a tied embedding/head weight, a
frozen unit, a parameter that forward never uses (``unused``, in the root unit: fairscale cannot
run a whole FSDP unit that forward skips), and parameters split into two param groups along unit
boundaries (group 1 = ``block2``, with a different learning rate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP

VOCAB, DIM, SEQ, GLOBAL_BATCH = 11, 6, 5, 12  # GLOBAL_BATCH divisible by 1, 2, 3, 4


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Block2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 5)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.proj(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block1 = nn.Sequential(nn.Linear(DIM, 7), nn.Tanh(), nn.Linear(7, DIM))
        self.block2 = Block2()
        self.frozen = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight  # tied
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.block1(x)
        x = self.block2(x)
        x = self.frozen(x)
        return self.head(self.norm(x))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


# Which submodules become their own FSDP unit, per nesting style. Every style keeps block2 (group 1)
# apart from the rest (group 0), so the two param groups never split a unit.
NESTINGS: dict[str, tuple[str, ...]] = {
    "deep": ("block2.inner", "block2", "block1", "frozen"),
    "shallow": ("block2", "frozen"),
}


def wrap(net: Net, nesting: str = "deep", *, flatten: bool = True, **fsdp_kwargs: Any) -> FSDP:
    """Wrap the units named by ``NESTINGS[nesting]`` (innermost first), then the root."""
    kwargs = dict(flatten_parameters=flatten, **fsdp_kwargs)
    for path in NESTINGS[nesting]:
        parent_path, _, name = path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        setattr(parent, name, FSDP(getattr(parent, name), **kwargs))
    return FSDP(net, **kwargs)


def is_group1(name: str) -> bool:
    return name.startswith("block2.")


GROUP1_LR = 0.02


def fsdp_param_groups(root: FSDP) -> list[dict[str, Any]]:
    block2 = root.module.block2  # the block2 FSDP instance; its parameters() include its nested units
    group1 = list(block2.parameters())
    ids = {id(p) for p in group1}
    group0 = [p for p in root.parameters() if id(p) not in ids]
    return [{"params": group0}, {"params": group1, "lr": GROUP1_LR}]


def plain_param_groups(net: nn.Module) -> list[dict[str, Any]]:
    named = list(net.named_parameters())
    return [
        {"params": [p for n, p in named if not is_group1(n)]},
        {"params": [p for n, p in named if is_group1(n)], "lr": GROUP1_LR},
    ]


def plain_param_names(net: nn.Module) -> dict[int, str]:
    """Id -> name for an optimizer built from ``plain_param_groups(net)`` (ids run group by group)."""
    named = [n for n, _ in net.named_parameters()]
    ordered = [n for n in named if not is_group1(n)] + [n for n in named if is_group1(n)]
    return dict(enumerate(ordered))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
    "adadelta": lambda groups: torch.optim.Adadelta(groups, lr=1.0),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, momentum=0.5, centered=True),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=0.01),
}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: (tokens, targets), both [GLOBAL_BATCH, SEQ]."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return tokens, targets


def local_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = batch(step)
    per = GLOBAL_BATCH // world_size
    return tokens[rank * per : (rank + 1) * per], targets[rank * per : (rank + 1) * per]


def train_step(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    optim.zero_grad()
    logits = model(tokens).float()
    F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    optim.step()


def train_plain(optimizer: str, steps: range, net: Net | None = None, optim: Any = None) -> tuple[Net, Any]:
    """Unwrapped reference training on the global batches of ``steps``."""
    net = net or make_net()
    optim = optim or OPTIMIZERS[optimizer](plain_param_groups(net))
    for step in steps:
        train_step(net, optim, *batch(step))
    return net, optim
