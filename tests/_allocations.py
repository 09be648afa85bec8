"""Host memory a block of code allocates, seen through torch's dispatcher: every new CPU tensor, by size in bytes.

A test that claims a path copies nothing into pageable memory counts what it allocates on the host: a factory
(``empty``, ``zeros``...) or an op that returns new memory (``clone``, ``_to_copy``, ``cat``). A view, or memory
the file system hands over (``torch.frombuffer`` of a mapping), allocates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostAllocations(TorchDispatchMode):
    """Every host tensor allocated while active, its storage's size in bytes, in ``sizes``."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        made = name.startswith(("empty", "new_", "zeros", "ones", "full")) or name in {"clone", "_to_copy", "cat"}
        if made and torch.is_tensor(out) and out.device.type == "cpu":
            self.sizes.append(out.untyped_storage().nbytes())
        return out

    def above(self, nbytes: int) -> list[int]:
        """The allocations larger than ``nbytes``, largest first."""
        return sorted((n for n in self.sizes if n > nbytes), reverse=True)
