"""Planning that scales: a rank plans only the units and saved ranks it overlaps, by interval lookup.

Records and tensors, no process (the last test writes real files). The interval planner (``rank_reads``, ``saved_ranks``,
``intervals.pieces``) is compared with the brute-force planner it replaced, which walked every segment
of every unit and every saved rank of every unit (``shard_bounds`` per (unit, rank)), on random layouts;
and a rank of a 4,096-rank job with 1,000 units is planned while counting the per-(unit, rank) records
built (``FlatParamLayout.at_rank`` and ``shard_bounds``, wrapped: call counters on the real code); and a
rank re-cutting its shard from a real checkpoint reads only the rank files its plan names.
"""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_optim.core import layout as layout_module
from fsdp_optim.core.execute import Read, cut_rank, rank_reads, saved_ranks
from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.intervals import ShardIndex, padding_per_rank
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec, shard_bounds
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.source import Source

STATE = (StateEntry("exp_avg", StateKind.SHARDED, dtype="float32"), StateEntry("step", StateKind.SCALAR, value=3))


def _units(names: list[str], sizes: dict[str, int], cuts: list[int], world_size: int) -> tuple[FlatParamLayout, ...]:
    """``names`` cut into consecutive units at ``cuts``, each flattened over ``world_size`` ranks."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(names))), len(names)]
    flats = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        specs, offset = [], 0
        for name in names[a:b]:
            specs.append(ParamSpec(name, (sizes[name],), offset))
            offset += sizes[name]
        flats.append(FlatParamLayout(f"u{k}", tuple(specs), world_size, 0, torch.float32, True))
    return tuple(flats)


def _source(flats: tuple[FlatParamLayout, ...], world_size: int, read=None) -> Source:  # type: ignore[no-untyped-def]
    records = tuple(FlatRecord.from_layout(f, STATE) for f in flats)
    group = GroupRecord({"lr": 0.1}, tuple(range(len(records))))
    return Source("the source", "Adam", records, (group,), read or (lambda *a: None), world_size)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Source, ModelLayout, dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """A source saved at ``n`` ranks (its rank shards of ``exp_avg``) and a target of other units at ``m`` ranks."""
    count = draw(st.integers(1, 8))
    names = [f"p{i}" for i in range(count)]
    sizes = {n: draw(st.integers(1, 13)) for n in names}
    n, m = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    src = _units(names, sizes, draw(st.lists(st.integers(0, count), max_size=4)), n)
    order = draw(st.permutations(names))
    dst = _units(list(order), sizes, draw(st.lists(st.integers(0, count), max_size=4)), m)
    values = {name: torch.randn(sizes[name]) for name in names}
    shards = []  # shards[unit][rank]: the padded shard a rank file holds
    for flat in src:
        full = torch.cat([values[p.name] for p in flat.params])
        shards.append([_padded(full, flat.bounds(r)) for r in range(n)])
    return _source(src, n), ModelLayout(dst, tuple(names), m, 0), values, shards


def _padded(full: torch.Tensor, bounds) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat([full[bounds.start : bounds.stop], torch.zeros(bounds.padding)])


def _brute_reads(the_plan, rank: int) -> list[Read]:  # type: ignore[no-untyped-def]
    """The replaced planner: every segment of every unit, each checked against the rank's bounds."""
    out = []
    for t, flat_plan in the_plan.flats.items():
        flat = the_plan.target.flat_params[t]
        b = flat.at_rank(rank).bounds()
        for seg in flat_plan.segments:
            lo, hi = max(seg.start, b.start), min(seg.stop, b.stop)
            if lo < hi:
                out.append(Read(t, lo - b.start, hi - b.start, seg.source, seg.source_start + lo - seg.start))
    return out


def _brute_ranks(the_plan, reads: list[Read]) -> list[int]:  # type: ignore[no-untyped-def]
    """The replaced reader: every saved rank of a source unit, its bounds built per rank."""
    found = set()
    for r in reads:
        flat = the_plan.source.flats[r.source]
        for saved in range(flat.world_size):
            b = flat.layout(saved).bounds()
            if max(b.start, r.source_start) < min(b.stop, r.source_start + r.stop - r.start):
                found.add(saved)
    return sorted(found)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_interval_planner_matches_the_brute_force_planner(case) -> None:  # type: ignore[no-untyped-def]
    source, target, values, shards = case
    index = ShardIndex.of(source.flats)

    def read(s: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        # what the sharded reader does: only the saved ranks holding [start, stop), found by arithmetic
        chunk = index.shard_numel(s)
        for saved, lo, hi in index.pieces(s, start, stop):
            out[lo - start : hi - start].copy_(shards[s][saved][lo - saved * chunk : hi - saved * chunk])

    the_plan = plan(Source(source.label, source.optimizer, source.flats, source.groups, read, source.world_size), target)
    for rank in range(target.world_size):
        reads = rank_reads(the_plan, rank)
        assert list(reads) == _brute_reads(the_plan, rank), rank
        assert saved_ranks(the_plan, rank) == _brute_ranks(the_plan, list(reads)), rank
        state = cut_rank(the_plan, rank)
        for t, flat in enumerate(target.flat_params):
            full = torch.cat([values[p.name] for p in flat.params])
            assert torch.equal(state[t]["exp_avg"], _padded(full, flat.bounds(rank))), (rank, t)
            assert state[t]["step"] == 3


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.integers(1, 17), st.data())
def test_pieces_and_padding_match_per_rank_bounds(numel: int, world_size: int, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    bounds = [shard_bounds(numel, world_size, r) for r in range(world_size)]
    expected = [(r, max(b.start, start), min(b.stop, stop)) for r, b in enumerate(bounds) if max(b.start, start) < min(b.stop, stop)]
    assert list(ShardIndex((numel,), (world_size,), (False,)).pieces(0, start, stop)) == expected
    assert padding_per_rank(numel, world_size) == [b.padding for b in bounds]


def test_planning_one_rank_of_4096_with_1000_units_builds_no_per_rank_records() -> None:
    units, world_size, target_size, rank = 1000, 4096, 3072, 2049
    names = [f"layers.{u}.{p}" for u in range(units) for p in ("w", "b")]
    sizes = {n: (8192 if n.endswith("w") else 64) for n in names}
    cuts = list(range(2, 2 * units, 2))
    source = _source(_units(names, sizes, cuts, world_size), world_size)
    target = ModelLayout(_units(names, sizes, cuts, target_size), tuple(names), target_size, 0)
    with mock.patch.object(FlatParamLayout, "at_rank", autospec=True, side_effect=FlatParamLayout.at_rank) as at_rank, \
            mock.patch.object(layout_module, "shard_bounds", wraps=shard_bounds) as bounds:
        the_plan = plan(source, target)
        reads = rank_reads(the_plan, rank)
        files = saved_ranks(the_plan, rank)
        state = cut_rank(the_plan, rank)
    assert (at_rank.call_count, bounds.call_count) == (0, 0)  # no record per (unit, rank), not even one per unit
    assert len(reads) == units and len(state) == units
    # 8256 elements over 3072 ranks (3 each) lie on one or two of the 4096 saved ranks (2 or 3 each)
    assert 1 <= len(files) <= 2 * units and all(0 <= f < world_size for f in files)
    assert files == _brute_ranks(the_plan, list(reads[:3]))  # every unit has the same shapes


def test_a_rank_re_cutting_its_shard_reads_only_the_rank_files_it_overlaps(tmp_path) -> None:
    """Real files: a checkpoint of 8 ranks re-cut for rank 1 of 4 needs saved ranks 1..3 only; with every
    other rank file removed, the lazy reader (as a job's load uses it) still builds the same shard."""
    import shutil

    from fsdp_optim import reshard
    from fsdp_optim.formats.sharded.manifest import Manifest
    from fsdp_optim.formats.sharded.reader import open_checkpoint

    names = [f"u{u}.{p}" for u in range(3) for p in ("w", "b")]
    sizes = {n: (37 if n.endswith("w") else 5) for n in names}
    saved = ModelLayout(_units(names, sizes, [2, 4], 8), tuple(names), 8, 0)
    g = torch.Generator().manual_seed(0)
    state = {i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(sizes[n], generator=g)} for i, n in enumerate(names)}
    full = {
        "state": state,
        "param_groups": [{"lr": 0.1, "params": list(range(len(names)))}],
        "param_names": dict(enumerate(names)),
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 8, "scalar_keys": ["step"]},
    }
    reshard(full, 8, tmp_path / "ckpt", layout=Manifest.from_layout(saved, save_id="layout"))
    shutil.copytree(tmp_path / "ckpt", tmp_path / "whole")
    target = ModelLayout(_units(names, sizes, [2, 4], 4), tuple(names), 4, 0)
    with open_checkpoint(tmp_path / "whole", lazy=False) as ckpt:
        the_plan = plan(ckpt.source(), target)
        expected = cut_rank(the_plan, 1)
        needed = saved_ranks(the_plan, 1)
        removed = [tmp_path / "ckpt" / f.file for f in ckpt.manifest.files if f.rank not in needed]
    assert needed == [1, 2, 3], needed  # 42 elements a unit: rank 1 of 4 holds [11, 22), saved chunks are 6 long
    for path in removed:
        path.unlink()
    with open_checkpoint(tmp_path / "ckpt", lazy=True) as ckpt:
        the_plan = plan(ckpt.source(), target)
        ckpt.open_ranks(saved_ranks(the_plan, 1))
        found = cut_rank(the_plan, 1)
    assert found.keys() == expected.keys()
    for t in expected:
        assert torch.equal(found[t]["exp_avg"], expected[t]["exp_avg"]) and found[t]["step"] == expected[t]["step"], t
