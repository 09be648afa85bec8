"""Per-sample randomness that does not depend on which rank sees the sample, or on how many ranks there are; pure.

A per-rank generator (``torch.manual_seed(seed + rank)``) draws a sample's augmentation from whatever that rank drew
before: after a resume at another world size the same sample lands on another rank, after other draws, and gets
other random numbers. Drawing from the seed and the sample's global index instead gives the same numbers wherever
and whenever the sample is seen::

    def __getitem__(self, index):
        g = fsdp_optim.sample_generator(self.seed, index, epoch=self.epoch)
        crop = torch.randint(0, 8, (2,), generator=g)          # the same on any rank, at any world size

What cannot carry over this way: randomness drawn per rank inside the model (dropout, stochastic depth) from the
global or CUDA generator. Its stream depends on the rank and the world size, so a resumed run at another world size
draws other masks; train without dropout where the trajectory must match, or accept a run that matches only in
distribution (reseed per rank from ``extra``).
"""

from __future__ import annotations

import torch

__all__ = ["sample_generator", "sample_seed"]

_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: every input bit moves every output bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def sample_seed(seed: int, index: int, *, epoch: int = 0) -> int:
    """A seed in [0, 2**63) for sample ``index`` (its global index in the dataset) of ``epoch`` in a job seeded with
    ``seed``: a function of those three numbers alone, so the same on whichever rank sees the sample."""
    for name, value in (("seed", seed), ("index", index), ("epoch", epoch)):
        if type(value) is not int or value < 0:
            raise ValueError(f"sample_seed: {name} must be an int >= 0, found {value!r}")
    mixed = _mix((seed & _MASK) ^ 0x9E3779B97F4A7C15)
    mixed = _mix((mixed + epoch) & _MASK)
    return _mix((mixed + index) & _MASK) >> 1


def sample_generator(seed: int, index: int, *, epoch: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with :func:`sample_seed` (``seed``, ``index``, ``epoch``): draw
    sample ``index``'s augmentation or masking from it to get the same numbers on any rank and at any world size."""
    generator = torch.Generator(device=device)
    generator.manual_seed(sample_seed(seed, index, epoch=epoch))
    return generator
