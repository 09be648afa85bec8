"""The demo's data: a small synthetic dataset read through a real ``DataLoader`` with
:class:`~fsdp_optim.ResumableSampler`, epoch after epoch, the sampler's position moved past every batch trained on."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from fsdp_optim.core.data_position import sample_generator
from fsdp_optim.job.sampler import ResumableSampler

__all__ = ["DATA_SEED", "EPOCH_BATCHES", "SEQ", "VOCAB", "Loader", "Synthetic", "stream", "synthetic_loader"]

VOCAB, SEQ = 64, 16  # the demo model's
DATA_SEED, EPOCH_BATCHES = 7, 3  # the dataset holds 3 global batches: the demo's runs cross epochs

Loader = tuple[ResumableSampler, DataLoader]


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``length`` token sequences (inputs, next-token targets); sample i is drawn from the seed and i alone."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=sample_generator(DATA_SEED, index))
        return tokens[:-1], tokens[1:]


def synthetic_loader(global_batch: int, ranks: int, rank: int) -> Loader:
    """Rank ``rank``'s sampler and loader at ``ranks`` ranks over global batches of ``global_batch`` samples."""
    dataset = Synthetic(EPOCH_BATCHES * global_batch)
    sampler = ResumableSampler(dataset, ranks, rank, seed=DATA_SEED, global_batch_size=global_batch)
    return sampler, DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler)


def stream(sampler: ResumableSampler, loader: DataLoader, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The next ``count`` batches, epoch after epoch; the sampler's position moves past each once it is trained."""
    taken = 0
    while taken < count:
        sampler.set_epoch(sampler.epoch)  # a restored epoch keeps its position
        for batch in loader:
            yield batch
            sampler.advance()
            taken += 1
            if taken == count:
                return
        sampler.set_epoch(sampler.epoch + 1)
