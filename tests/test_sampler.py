"""ResumableSampler against torch's DistributedSampler, and its position resumed at other world sizes; pure, no ranks.

What happens at each edge, as the tests below say it:
- at the same world size, the order is DistributedSampler's, index for index (any shuffle, drop_last, seed, length);
- global batch t is the window order[t*B:(t+1)*B] of the epoch's padded order, at any world size;
- an epoch's tail depends on the world size (padding repeats the order's first samples, drop_last cuts the last):
  a resume there reports how many samples it repeats or skips, and warns;
- a finished epoch resumes at its end: nothing left, the next set_epoch starts the next epoch;
- another global batch is refused, naming both, unless allowed: then the stream goes on from the same sample.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from fsdp_optim import DataPosition, ResumableSampler, sample_generator, sample_seed
from fsdp_optim.core.data_position import epoch_order, padded_order, total_size


def _samplers(length: int, world: int, **kw: object) -> list[ResumableSampler]:
    return [ResumableSampler(list(range(length)), world, r, **kw) for r in range(world)]  # type: ignore[arg-type]


def _global_batches(samplers: list[ResumableSampler], per_rank: int) -> list[list[int]]:
    """What a DataLoader with ``per_rank`` per batch gives each rank, joined rank by rank into global batches (the
    window order: rank r's i-th sample of a batch is the window's (i*W + r)-th)."""
    shares = [list(s) for s in samplers]
    world, out = len(samplers), []
    for start in range(0, len(shares[0]), per_rank):
        local = [share[start : start + per_rank] for share in shares]
        out.append([local[r][i] for i in range(len(local[0])) for r in range(world) if i < len(local[r])])
    return out


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(1, 70),
    world=st.integers(1, 8),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_the_order_is_distributed_samplers_index_for_index(
    length: int, world: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    data = list(range(length))
    for rank in range(world):
        theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        ours = ResumableSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        theirs.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert list(ours) == list(theirs), f"rank {rank}: the order differs from DistributedSampler's"
        assert len(ours) == len(theirs) and ours.total_size == theirs.total_size, "lengths differ"
        assert isinstance(ours, DistributedSampler), "a drop-in: code that checks for DistributedSampler finds one"


@settings(max_examples=60, deadline=None)
@given(
    steps=st.integers(0, 6),
    world=st.sampled_from([1, 2, 3, 4, 6, 12]),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_a_resume_at_any_world_size_keeping_the_global_batch_sees_the_same_global_batches(
    steps: int, world: int, shuffle: bool, drop_last: bool, seed: int
) -> None:
    length, batch = 72, 12  # 6 global batches; 72 is a multiple of every world size here: no tail differs
    kw = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last, "global_batch_size": batch}
    uninterrupted = _global_batches(_samplers(length, 2, **kw), batch // 2)
    saved = _samplers(length, 2, **kw)[0]
    saved.advance(steps)
    resumed = _samplers(length, world, **kw)
    for sampler in resumed:
        report = sampler.load_state_dict(saved.state_dict())
        assert (report.repeated, report.skipped) == (0, 0), str(report)
    assert _global_batches(resumed, batch // world) == uninterrupted[steps:], "the global batches differ"


def test_the_epoch_tail_depends_on_the_world_size_and_a_resume_says_what_differs() -> None:
    """50 samples, global batch 12: at 2 ranks the epoch is 50 positions (4 full batches and one of 2); at 3 ranks
    drop_last=False pads it to 51 (one sample of the order's start again), drop_last=True cuts it to 48."""
    saved = ResumableSampler(list(range(50)), 2, 0, seed=3, global_batch_size=12)
    saved.advance(4)
    assert saved.consumed == 48, saved.consumed
    padded = ResumableSampler(list(range(50)), 3, 1, seed=3, global_batch_size=12)
    with pytest.warns(UserWarning, match="1 samples repeated, 0 skipped"):
        report = padded.load_state_dict(saved.state_dict())
    assert (report.start, report.repeated, report.skipped) == (48, 1, 0), report
    assert len(padded) == 1, "each of the 3 ranks gets one of positions 48, 49 and 50 (the padding)"
    cut = [ResumableSampler(list(range(50)), 3, r, seed=3, drop_last=True, global_batch_size=12) for r in range(3)]
    saved_cut = ResumableSampler(list(range(50)), 2, 0, seed=3, drop_last=True, global_batch_size=12)
    saved_cut.advance(4)
    with pytest.warns(UserWarning, match="0 samples repeated, 2 skipped"):
        reports = [s.load_state_dict(saved_cut.state_dict()) for s in cut]
    assert all(len(s) == 0 for s in cut), "at 3 ranks drop_last cuts the epoch at 48: nothing is left of it"
    assert reports[0].skipped == 2, reports[0]


def test_the_last_partial_batch_ends_the_epoch_and_a_resume_there_starts_nothing_until_set_epoch() -> None:
    saved = ResumableSampler(list(range(50)), 2, 0, global_batch_size=12)
    saved.advance(5)  # 4 full batches and the partial one: the epoch is done
    assert saved.consumed == saved.total_size == 50, saved.consumed
    resumed = [ResumableSampler(list(range(50)), 3, r, global_batch_size=12) for r in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of the epoch is left on either side: nothing differs
        for s in resumed:
            s.load_state_dict(saved.state_dict())
    assert [len(s) for s in resumed] == [0, 0, 0], "the finished epoch has nothing left at any world size"
    for s in resumed:
        s.set_epoch(s.epoch)  # the loop's set_epoch of the restored epoch keeps the position
        assert list(s) == [], "set_epoch of the current epoch keeps it finished"
        s.set_epoch(1)
    fresh = DistributedSampler(list(range(50)), 3, 2)
    fresh.set_epoch(1)
    assert list(resumed[2]) == list(fresh), "the next epoch starts at its first sample, DistributedSampler's order"


def test_another_global_batch_is_refused_naming_both_or_allowed_with_a_count() -> None:
    saved = ResumableSampler(list(range(60)), 2, 0, global_batch_size=12)
    saved.advance(1)
    other = ResumableSampler(list(range(60)), 5, 0, global_batch_size=10)
    with pytest.raises(ValueError, match=r"global batch was 12 samples \(2 ranks x 6\) and is 10 now \(5 ranks x 2\)"):
        other.load_state_dict(saved.state_dict())
    assert (other.epoch, other.consumed, other.resumed) == (0, 0, None), "a refused load changed the sampler"
    allowed = ResumableSampler(list(range(60)), 5, 0, global_batch_size=10, allow_batch_change=True)
    with pytest.warns(UserWarning, match="2 samples repeated, 0 skipped"):
        report = allowed.load_state_dict(saved.state_dict())
    assert report.start == 10, "sample 12 rounded down to a multiple of 5 ranks: samples 10 and 11 are seen again"


@settings(max_examples=120, deadline=None)
@given(
    length=st.integers(1, 40),
    saved_world=st.integers(1, 6),
    world=st.integers(1, 6),
    per_rank=st.integers(1, 4),
    batches=st.integers(0, 12),
    drop_last=st.booleans(),
)
def test_the_counts_of_repeated_and_skipped_samples_are_the_multisets_difference(
    length: int, saved_world: int, world: int, per_rank: int, batches: int, drop_last: bool
) -> None:
    batch = per_rank * saved_world
    saved = ResumableSampler(list(range(length)), saved_world, 0, drop_last=drop_last, global_batch_size=batch)
    saved.advance(batches)
    live = ResumableSampler(list(range(length)), world, 0, drop_last=drop_last, global_batch_size=per_rank * world,
                            allow_batch_change=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = live.load_state_dict(saved.state_dict())
    order = epoch_order(length, 0, 0, True)
    before = Counter(padded_order(order, saved_world, drop_last)[saved.consumed :])
    after = Counter(padded_order(order, world, drop_last)[report.start :])
    assert (report.repeated, report.skipped) == ((after - before).total(), (before - after).total()), report
    assert report.start % world == 0 and report.start <= total_size(length, world, drop_last), report
    counts = set()
    for rank in range(world):
        other = ResumableSampler(list(range(length)), world, rank, drop_last=drop_last,
                                 global_batch_size=per_rank * world, allow_batch_change=True)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other.load_state_dict(saved.state_dict())
        counts.add(len(other))
    assert len(counts) == 1, f"the ranks get different numbers of samples: {counts}"


def test_another_dataset_seed_or_drop_last_is_refused_with_every_difference() -> None:
    saved = ResumableSampler(list(range(60)), 2, 0, seed=1, global_batch_size=12).state_dict()
    live = ResumableSampler(list(range(61)), 2, 0, seed=2, drop_last=True, global_batch_size=12)
    with pytest.raises(ValueError) as info:
        live.load_state_dict(saved)
    for said in ("dataset_length is 60 in the checkpoint but 61", "seed is 1", "drop_last is False"):
        assert said in str(info.value), str(info.value)


def test_the_position_is_a_versioned_record_and_bad_ones_are_refused() -> None:
    sampler = ResumableSampler(list(range(60)), 3, 1, seed=4, global_batch_size=12)
    sampler.set_epoch(2)
    sampler.advance(2)
    state = sampler.state_dict()
    assert state == {"version": 1, "seed": 4, "epoch": 2, "consumed": 24, "global_batch": 12, "dataset_length": 60,
                     "shuffle": True, "drop_last": False, "world_size": 3}, state  # fmt: skip
    assert DataPosition.from_dict(state, where="here") == sampler.position(), "the dict round-trips"
    with pytest.raises(ValueError, match="version 2"):
        DataPosition.from_dict({**state, "version": 2}, where="here")
    with pytest.raises(ValueError, match="'shuffle' must be bool, found int 1"):
        DataPosition.from_dict({**state, "shuffle": 1}, where="here")
    with pytest.raises(ValueError, match="consumed 61 is outside the epoch's 0..60"):
        DataPosition.from_dict({**state, "consumed": 61}, where="here")
    with pytest.raises(ValueError, match="a positive multiple of num_replicas=5"):
        ResumableSampler(list(range(60)), 5, 0, global_batch_size=12)
    with pytest.raises(ValueError, match="needs the global batch: pass global_batch_size="):
        ResumableSampler(list(range(60)), 2, 0).advance()


def test_per_sample_randomness_depends_on_the_seed_epoch_and_index_alone() -> None:
    a = torch.rand(4, generator=sample_generator(7, 123, epoch=2))
    b = torch.rand(4, generator=sample_generator(7, 123, epoch=2))
    assert torch.equal(a, b), "the same sample draws the same numbers wherever it is seen"
    seeds = {sample_seed(7, i, epoch=e) for i in range(200) for e in range(3)}
    assert len(seeds) == 600 and all(0 <= s < 2**63 for s in seeds), "distinct, valid seeds"
    assert sample_seed(8, 123, epoch=2) != sample_seed(7, 123, epoch=2), "the job's seed matters"
    with pytest.raises(ValueError, match="index must be an int >= 0, found -1"):
        sample_seed(7, -1)
