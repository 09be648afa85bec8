"""What the hardware allows for the same bytes: the pinned device-to-host copy, that copy plus the write of the same
bytes into one file in the same directory, and the read of that file into pinned memory plus the host-to-device copy.
Buffers allocated once and reused, as a checkpointer that knows its state can."""

from __future__ import annotations

import os
import time

import torch

from benchmarks.gpu.models import Config, sync


class Floors:
    def __init__(self, tensors: list[torch.Tensor], config: Config) -> None:
        self.tensors = [t.detach().reshape(-1) for t in tensors]
        self.config = config
        pin = config.on_gpu
        self.host = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=pin) for t in self.tensors]
        self.path = os.path.join(config.directory, "floor.bin")

    def copy(self) -> float:
        """Device to (pinned) host, non-blocking copies, then one synchronize."""
        sync(self.config)
        start = time.perf_counter()
        for dst, src in zip(self.host, self.tensors, strict=True):
            dst.copy_(src.view(torch.uint8), non_blocking=self.config.on_gpu)
        sync(self.config)
        return time.perf_counter() - start

    def save(self) -> float:
        """The copy, then the write of the same bytes (one file, no fsync: tmpfs)."""
        start = time.perf_counter()
        self.copy()
        with open(self.path, "wb") as f:
            for buffer in self.host:
                f.write(memoryview(buffer.numpy()))
        return time.perf_counter() - start

    def load(self) -> float:
        """Read the file back into the pinned buffers, copy them to the device, synchronize."""
        sync(self.config)
        start = time.perf_counter()
        with open(self.path, "rb", buffering=0) as f:
            for dst, buffer in zip(self.tensors, self.host, strict=True):
                f.readinto(memoryview(buffer.numpy()))
                dst.view(torch.uint8).copy_(buffer, non_blocking=self.config.on_gpu)
        sync(self.config)
        return time.perf_counter() - start

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)
