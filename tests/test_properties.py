"""Property-based tests of the pure layer: layouts, flat shards and the full dict, without processes.

Hypothesis draws a synthetic model (parameter shapes, dtypes, param groups, frozen parameters,
per-parameter state of three kinds: tensors shaped like the parameter, 0-dim tensors, Python scalars)
and wraps it in synthetic ``ModelLayout`` records: a random grouping of parameters into FSDP units,
flattened or not, sharded over 1 to 16 ranks or not sharded, in a random FSDP-instance order, with a
random optimizer order inside each param group. Nothing here starts a process or calls a collective.

The gather side is driven through the same pure functions the FSDP subclass uses
(``read_local_state`` -> ``check_agreement`` -> ``assemble`` -> ``build_full_state``); the load
side through ``shard_full_state`` (here: one plan, then ``cut_rank``, as ``get_shard_from_optim_state_dict``
runs). The reference for "a shard" is fairscale's own ``_get_shard`` (``torch.chunk`` plus zero padding), called
on a full flat tensor built by ``torch.cat``.

Properties:

1. ``shard_bounds`` cuts exactly like fairscale's ``_get_shard`` for every numel, world size and rank.
2. One flat parameter: ``cut`` matches ``_get_shard``; ``assemble`` inverts it whatever the padding holds.
3. full -> shards (world size N) -> full is the identity, bit for bit (values, dtypes, Python types),
   even with garbage written into every shard's padding; the input dict is never modified and the
   shards share no memory with it.
4. shards at N -> full -> shards at M (another grouping into units, other world size) equals fairscale's
   sharding of the original full dict, computed directly.
5. Padding never leaks into a full dict: every state tensor has exactly its parameter's shape; new shards
   carry zeros in their padding.
6. Without a live optimizer, shard ids follow ``param_positions`` inside each of the dict's groups.
"""

from __future__ import annotations

import copy
import math
import os
import types
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch
from _checks import assert_identical
from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from fsdp_optim.core.execute import cut_rank, optimizer_state_dict
from fsdp_optim.core.flatten import StateKind, assemble, split
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec, shard_bounds
from fsdp_optim.core.plan import plan
from fsdp_optim.formats.fullstate import FORMAT_KEY, FORMAT_VERSION, build_full_state, full_dict_source
from fsdp_optim.job.local import check_agreement, read_local_state

# Each property runs in a few seconds at these settings on one core; derandomized so that CI explores
# the same examples every run (a new failure is a code change, not a dice roll). A failure is reported
# at once with the example that found it; shrinking that example to a minimal one can take minutes, so
# it is opt-in: FSDP_OPTIM_SHRINK=1 python -m pytest tests/test_properties.py
PROPERTY_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    phases=tuple(Phase) if os.environ.get("FSDP_OPTIM_SHRINK") else tuple(p for p in Phase if p is not Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TENSOR_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "square_avg")
# (key, kind): kind is how one value is made; the same key always has the same kind, as in torch.
SCALAR_KEYS = (
    ("step", "tensor float32"),
    ("mu_product", "tensor float64"),
    ("count", "tensor int64"),
    ("eta", "python float"),
    ("k", "python int"),
)
# 1 to 16, drawn evenly: plain st.integers(1, 16) gives 1 nearly half the time. The first entry is what
# hypothesis falls back to most, so it is a world size that pads.
WORLD_SIZES = st.sampled_from([3, 2, 16, 4, 5, 1, 7, 8, 6, 9, 10, 11, 12, 13, 14, 15])
OPTIMIZER = "Synthetic"
PADDING_GARBAGE = 512.0  # a power of two: exact in every dtype drawn; randn state never reaches it


def fairscale_shard(flat_full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The reference shard: fairscale FSDP's own cutting of a flat tensor (torch.chunk + zero padding)."""
    shard, _ = FairscaleFSDP._get_shard(types.SimpleNamespace(world_size=world_size, rank=rank), flat_full)
    return shard


# ------------------------------------------------------------------------------------------------
# A synthetic model: parameters, their blocks (what must stay together), param groups, full state


@dataclass
class Block:
    """Parameters that may share a flat parameter: same param group, dtype, state presence and scalars."""

    group: int | None  # None: frozen, in no param group
    dtype: torch.dtype
    has_state: bool
    scalars: dict[str, Any] = field(default_factory=dict)  # one value per scalar key, shared by the block


@dataclass
class Synthetic:
    names: list[str]  # the unwrapped model's named_parameters() order
    shapes: dict[str, tuple[int, ...]]
    block_of: dict[str, int]
    blocks: list[Block]
    hyperparams: list[dict[str, Any]]  # per param group, in optimizer order
    named_groups: list[bool]  # the group carries "param_names"
    tensor_keys: tuple[str, ...]
    scalar_kinds: dict[str, str]
    seed: int

    def in_group(self, name: str) -> int | None:
        return self.blocks[self.block_of[name]].group


class Flat(NamedTuple):
    unit: str
    names: tuple[str, ...]  # in flat order
    flattened: bool
    sharded: bool  # False: every rank holds it whole
    dtype: torch.dtype


@dataclass
class Wrapping:
    """How the synthetic model is cut into flat parameters (independent of the rank)."""

    flats: list[Flat]  # in FSDP-instance order
    world_size: int
    live_groups: list[list[int]]  # flat indices per param group, in the live optimizer's order
    positions: list[int]  # position of each flat parameter in model.parameters()

    def layout(self, model: Synthetic, rank: int) -> ModelLayout:
        flats = []
        for unit, names, flattened, sharded, dtype in self.flats:
            specs, offset = [], 0
            for name in names:
                specs.append(ParamSpec(name, model.shapes[name], offset))
                offset += math.prod(model.shapes[name])
            flats.append(
                FlatParamLayout(
                    unit=unit,
                    params=tuple(specs),
                    world_size=self.world_size if sharded else 1,
                    rank=rank if sharded else 0,
                    dtype=dtype,
                    flattened=flattened,
                )
            )
        return ModelLayout(tuple(flats), tuple(model.names), self.world_size, rank)

    def trainable(self, model: Synthetic) -> list[bool]:
        return [model.in_group(flat.names[0]) is not None for flat in self.flats]


def _scalar_value(kind: str, n: int) -> Any:
    return {
        "tensor float32": lambda: torch.tensor(float(n), dtype=torch.float32),
        "tensor float64": lambda: torch.tensor(n / 7.0, dtype=torch.float64),
        "tensor int64": lambda: torch.tensor(n, dtype=torch.int64),
        "python float": lambda: n / 3.0,
        "python int": lambda: n,
    }[kind]()


@st.composite
def synthetic_models(draw: st.DrawFn) -> Synthetic:
    n_params = draw(st.integers(1, 9))
    names = [f"layers.{i}.{draw(st.sampled_from(['weight', 'bias', 'scale']))}" for i in range(n_params)]
    # 0-dim parameters and dims of size 0 are rarer than in hypothesis's default mix, but legal.
    dim = st.integers(0, 6) if draw(st.sampled_from([False, False, False, True])) else st.integers(1, 6)
    shapes = {name: tuple(draw(dim) for _ in range(draw(st.sampled_from([1, 2, 2, 1, 3, 0, 2])))) for name in names}
    n_groups = draw(st.integers(1, 3))
    n_blocks = draw(st.integers(1, 4))
    blocks = []
    # Mostly tensor state plus scalars (Adam); sometimes scalars only.
    n_tensor_keys = draw(st.sampled_from([2, 1, 2, 1, 0]))
    tensor_keys = tuple(draw(st.permutations(TENSOR_KEYS))[:n_tensor_keys])
    n_scalar_keys = draw(st.integers(0 if tensor_keys else 1, 3))
    scalar_keys = draw(st.permutations(SCALAR_KEYS))[:n_scalar_keys]
    scalar_kinds = dict(scalar_keys)
    for _ in range(n_blocks):
        group = draw(st.sampled_from([*range(n_groups), None]))
        has_state = group is not None and draw(st.sampled_from([True, True, False]))
        scalars = {}
        if has_state:
            scalars = {key: _scalar_value(kind, draw(st.integers(0, 10**6))) for key, kind in scalar_keys}
        blocks.append(Block(group, draw(st.sampled_from(DTYPES)), has_state, scalars))
    block_of = {name: draw(st.integers(0, n_blocks - 1)) for name in names}
    hyperparams = [
        {
            "lr": draw(st.floats(1e-5, 1.0) | st.floats(1e-5, 1.0).map(torch.tensor)),  # torch accepts a Tensor lr
            "betas": (draw(st.floats(0.0, 0.999)), 0.999),
            "weight_decay": draw(st.sampled_from([0, 0.01, 0.1])),
            "foreach": None,
            "maximize": draw(st.booleans()),
        }
        for _ in range(n_groups)
    ]
    named = [draw(st.booleans()) for _ in range(n_groups)]
    seed = draw(st.integers(0, 2**31))
    return Synthetic(names, shapes, block_of, blocks, hyperparams, named, tensor_keys, scalar_kinds, seed)


@st.composite
def wrappings(draw: st.DrawFn, model: Synthetic, world_size: int) -> Wrapping:
    """A random FSDP wrapping: units never mix blocks (a real wrapping with valid param groups doesn't)."""
    flats = []
    for b, block in enumerate(model.blocks):
        members = [name for name in model.names if model.block_of[name] == b]
        if not members:
            continue
        unit_of = {name: draw(st.integers(0, 2)) for name in members}
        for u in sorted(set(unit_of.values())):
            # Inside a flat parameter, fairscale follows module order; the pure layer must not rely on it.
            in_unit = draw(st.permutations([name for name in members if unit_of[name] == u]))
            flattened = len(in_unit) > 1 or draw(st.booleans())
            unit = f"block{b}.unit{u}"
            pieces = [tuple(in_unit)] if flattened else [(name,) for name in in_unit]
            for piece in pieces:
                sharded = world_size > 1 and draw(st.booleans() | st.just(True))
                # fairscale keeps an unflattened parameter it does not shard in its own shape: a 0-dim one's state
                # per element cannot be told from its scalars (refused: test_unflattened_one_rank.py), so flat here.
                lone_0dim = not flattened and not sharded and model.shapes[piece[0]] == ()
                flats.append(Flat(unit, piece, flattened or lone_0dim, sharded, block.dtype))
    flats = draw(st.permutations(flats))  # FSDP-instance order is not the parameter order
    live_groups = []
    for k in range(len(model.hyperparams)):
        in_k = [i for i, flat in enumerate(flats) if model.in_group(flat.names[0]) == k]
        live_groups.append(draw(st.permutations(in_k)))
    positions = draw(st.permutations(range(len(flats))))
    return Wrapping(list(flats), world_size, live_groups, list(positions))


def full_state_dict(model: Synthetic, world_size: int) -> dict[str, Any]:
    """The full dict of the synthetic model, written from the format's definition in fullstate's docstring."""
    generator = torch.Generator().manual_seed(model.seed)
    order = {name: i for i, name in enumerate(model.names)}
    state: dict[int, dict[str, Any]] = {}
    groups, param_names = [], {}
    used_scalar_keys: set[str] = set()
    pid = 0
    for k, hyper in enumerate(model.hyperparams):
        members = sorted((n for n in model.names if model.in_group(n) == k), key=order.__getitem__)
        ids = list(range(pid, pid + len(members)))
        for i, name in zip(ids, members):
            param_names[i] = name
            block = model.blocks[model.block_of[name]]
            if block.has_state:
                entry: dict[str, Any] = {}
                for key in model.tensor_keys:
                    values = torch.randn(model.shapes[name], generator=generator, dtype=torch.float64)
                    entry[key] = values.to(block.dtype)
                for key, value in block.scalars.items():
                    entry[key] = value.clone() if torch.is_tensor(value) else value
                    used_scalar_keys.add(key)
                state[i] = entry
        pid += len(members)
        group = copy.deepcopy(hyper)
        group["params"] = ids
        if model.named_groups[k]:
            group["param_names"] = members
        groups.append(group)
    meta = {
        "version": FORMAT_VERSION,
        "optimizer": OPTIMIZER,
        "world_size": world_size,
        "scalar_keys": sorted(used_scalar_keys),
    }
    return {"state": state, "param_groups": groups, "param_names": param_names, FORMAT_KEY: meta}


# ------------------------------------------------------------------------------------------------
# The two directions, through the package's pure functions


def shard_full_state(
    layout: ModelLayout, full: dict[str, Any], *, members: Any, param_positions: Any, trainable: Any
) -> dict[str, Any]:
    """This rank's optimizer state dict cut from ``full``: the engine's load path, as the FSDP subclass runs it."""
    the_plan = plan(full_dict_source(full), layout, members=members, required=trainable, order=param_positions)
    assert isinstance(layout.rank, int), f"a layout at one rank, found {layout.rank!r}"
    return optimizer_state_dict(the_plan, cut_rank(the_plan, layout.rank))


def shard_all_ranks(model: Synthetic, wrapping: Wrapping, full: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's optimizer state dict cut from ``full`` (what each rank would load)."""
    return [
        shard_full_state(
            wrapping.layout(model, rank),
            full,
            members=wrapping.live_groups,
            param_positions=wrapping.positions,
            trainable=wrapping.trainable(model),
        )
        for rank in range(wrapping.world_size)
    ]


def gather_all_ranks(model: Synthetic, wrapping: Wrapping, local_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The full dict rebuilt from every rank's optimizer state dict, as the gather does it minus the transport."""
    locals_ = []
    for rank, optim_state in enumerate(local_dicts):
        layout = wrapping.layout(model, rank)
        # Stand-ins for the flat parameters the live optimizer would hold, and its state_dict(): a
        # torch optimizer built from named parameters reports their names in each group.
        params = [nn.Parameter(torch.empty(flat.shard_numel, dtype=flat.dtype)) for flat in layout.flat_params]
        optim_groups = [{"params": [params[i] for i in members]} for members in wrapping.live_groups]
        optim_state = dict(optim_state, param_groups=copy.deepcopy(optim_state["param_groups"]))
        for k, group in enumerate(optim_state["param_groups"]):
            if model.named_groups[k]:
                group["param_names"] = [f"flat{i}" for i in wrapping.live_groups[k]]
        locals_.append(read_local_state(layout, params, optim_state, optim_groups))
    layout = wrapping.layout(model, 0)
    check_agreement(layout, [local.summary for local in locals_])
    flat_states = {}
    for i in locals_[0].state:
        flat = layout.flat_params[i]
        flat_states[i] = {
            key: assemble(flat, [locals_[r].state[i][key] for r in range(flat.world_size)])
            if kind is StateKind.SHARDED
            else locals_[0].state[i][key]
            for key, kind, _ in locals_[0].summary[i]
        }
    return build_full_state(layout, locals_[0].groups, flat_states, optimizer=OPTIMIZER)


def expected_shards(model: Synthetic, wrapping: Wrapping, full: dict[str, Any], rank: int) -> dict[str, Any]:
    """Direct computation of one rank's state dict: per flat parameter, torch.cat then fairscale's cut."""
    id_of = {name: pid for pid, name in full["param_names"].items()}
    state, groups, next_id = {}, [], 0
    for k, members in enumerate(wrapping.live_groups):
        ids = []
        for i in members:
            ids.append(next_id)
            flat = wrapping.flats[i]
            entries = [full["state"].get(id_of[name]) for name in flat.names]
            if entries[0]:
                entry = {}
                for key in entries[0]:
                    if key in model.tensor_keys:
                        flat_full = torch.cat([e[key].reshape(-1) for e in entries])
                        if flat.sharded:
                            entry[key] = fairscale_shard(flat_full, wrapping.world_size, rank)
                        elif flat.flattened:
                            entry[key] = fairscale_shard(flat_full, 1, 0)
                        else:  # fairscale neither flattens nor shards it: the live shard is the parameter's shape
                            entry[key] = flat_full.view(model.shapes[flat.names[0]])
                    else:
                        entry[key] = entries[0][key]
                state[next_id] = entry
            next_id += 1
        group = {key: v for key, v in full["param_groups"][k].items() if key not in ("params", "param_names")}
        group["params"] = ids
        groups.append(group)
    return {"state": state, "param_groups": groups}


def storages(obj: Any) -> set[int]:
    if torch.is_tensor(obj):
        return {obj.untyped_storage().data_ptr()} if obj.numel() else set()
    if isinstance(obj, dict):
        return set().union(*(storages(v) for v in obj.values())) if obj else set()
    if isinstance(obj, (list, tuple)):
        return set().union(*(storages(v) for v in obj)) if obj else set()
    return set()


def fill_padding(local_dicts: list[dict[str, Any]], wrapping: Wrapping, model: Synthetic) -> None:
    """Write garbage into the padding of every shard (FSDP never promises what padding holds)."""
    for rank, optim_state in enumerate(local_dicts):
        layout = wrapping.layout(model, rank)
        ids = [i for members in wrapping.live_groups for i in members]
        for local_id, entry in optim_state["state"].items():
            bounds = layout.flat_params[ids[local_id]].bounds()
            for value in entry.values():
                if torch.is_tensor(value) and value.dim() == 1 and bounds.padding:
                    value[bounds.real :] = PADDING_GARBAGE


# ------------------------------------------------------------------------------------------------
# Properties


@PROPERTY_SETTINGS
@given(numel=st.integers(0, 300), world_size=WORLD_SIZES)
def test_shard_bounds_cut_like_fairscale(numel: int, world_size: int) -> None:
    flat_full = torch.arange(1, numel + 1, dtype=torch.float64)
    covered = []
    for rank in range(world_size):
        bounds = shard_bounds(numel, world_size, rank)
        reference = fairscale_shard(flat_full, world_size, rank)
        assert bounds.numel == reference.numel() == math.ceil(numel / world_size)
        assert torch.equal(reference[: bounds.real], flat_full[bounds.start : bounds.stop])
        assert not reference[bounds.real :].any(), "fairscale pads with zeros exactly where padding is"
        covered.extend(range(bounds.start, bounds.stop))
    assert covered == list(range(numel)), "real elements tile the flat tensor once, in rank order"


@PROPERTY_SETTINGS
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=5),
    world_size=WORLD_SIZES,
    dtype=st.sampled_from(DTYPES),
)
def test_assemble_inverts_fairscales_cut(
    shapes: list[tuple[int, ...]], world_size: int, dtype: torch.dtype
) -> None:
    specs, offset = [], 0
    for i, shape in enumerate(shapes):
        specs.append(ParamSpec(f"p{i}", shape, offset))
        offset += math.prod(shape)
    tensors = [torch.randn(shape, dtype=torch.float64).to(dtype) for shape in shapes]
    flat_full = torch.cat([t.reshape(-1) for t in tensors])
    layouts = [FlatParamLayout("unit", tuple(specs), world_size, r, dtype, True) for r in range(world_size)]
    shards = [fairscale_shard(flat_full, world_size, rank).clone() for rank in range(world_size)]
    for rank, shard in enumerate(shards):
        shard[layouts[rank].bounds().real :] = PADDING_GARBAGE
    rebuilt = assemble(layouts[0], shards)
    assert_identical(rebuilt, flat_full, "assembled flat tensor")
    for spec, piece, original in zip(specs, split(layouts[0], rebuilt), tensors, strict=True):
        assert_identical(piece, original, spec.name)


@PROPERTY_SETTINGS
@given(data=st.data(), model=synthetic_models(), world_size=WORLD_SIZES)
def test_full_to_shards_to_full_is_identity(data: st.DataObject, model: Synthetic, world_size: int) -> None:
    wrapping = data.draw(wrappings(model, world_size), label="wrapping")
    full = full_state_dict(model, world_size)
    before = copy.deepcopy(full)

    local_dicts = shard_all_ranks(model, wrapping, full)
    assert_identical(full, before, "input full dict after sharding")
    assert not storages(local_dicts) & storages(full), "shards must be new memory, not views of the full dict"

    fill_padding(local_dicts, wrapping, model)
    rebuilt = gather_all_ranks(model, wrapping, local_dicts)
    assert_identical(rebuilt, full, "rebuilt full dict")
    assert not storages(rebuilt) & storages(local_dicts), "the full dict must not alias the optimizer's state"
    entries = [(key, v) for entry in rebuilt["state"].values() for key, v in entry.items()]
    scalars = [v for key, v in entries if key in model.scalar_kinds and torch.is_tensor(v)]
    assert len(storages(scalars)) == len(scalars), "no two parameters may share one scalar tensor"


@PROPERTY_SETTINGS
@given(data=st.data(), model=synthetic_models(), n=WORLD_SIZES, m=WORLD_SIZES)
def test_reshard_n_to_m_matches_direct_computation(data: st.DataObject, model: Synthetic, n: int, m: int) -> None:
    at_n = data.draw(wrappings(model, n), label="wrapping at N")
    at_m = data.draw(wrappings(model, m), label="wrapping at M")
    original = full_state_dict(model, n)

    shards_n = shard_all_ranks(model, at_n, original)
    fill_padding(shards_n, at_n, model)
    via_full = gather_all_ranks(model, at_n, shards_n)
    shards_m = shard_all_ranks(model, at_m, via_full)

    for rank in range(m):
        assert_identical(shards_m[rank], expected_shards(model, at_m, original, rank), f"rank {rank} of {m}")


@PROPERTY_SETTINGS
@given(data=st.data(), model=synthetic_models(), world_size=WORLD_SIZES)
def test_padding_never_leaks(data: st.DataObject, model: Synthetic, world_size: int) -> None:
    wrapping = data.draw(wrappings(model, world_size), label="wrapping")
    local_dicts = shard_all_ranks(model, wrapping, full_state_dict(model, world_size))
    ids = [i for members in wrapping.live_groups for i in members]
    for rank, optim_state in enumerate(local_dicts):
        layout = wrapping.layout(model, rank)
        for local_id, entry in optim_state["state"].items():
            flat = layout.flat_params[ids[local_id]]
            bounds = flat.bounds()
            for key in model.tensor_keys:
                assert entry[key].shape == flat.shard_shape, f"rank {rank}: '{key}' is {tuple(entry[key].shape)}"
                assert not entry[key].reshape(-1)[bounds.real :].any(), f"rank {rank}: '{key}' padding is not zero"

    fill_padding(local_dicts, wrapping, model)
    rebuilt = gather_all_ranks(model, wrapping, local_dicts)
    for pid, entry in rebuilt["state"].items():
        name = rebuilt["param_names"][pid]
        for key in model.tensor_keys:
            assert entry[key].shape == model.shapes[name], f"{name}[{key}]: {tuple(entry[key].shape)}"
            assert not (entry[key] == PADDING_GARBAGE).any(), f"{name}[{key}] holds padding"


@PROPERTY_SETTINGS
@given(data=st.data(), model=synthetic_models(), world_size=WORLD_SIZES)
def test_ids_follow_param_positions_without_live_optimizer(
    data: st.DataObject, model: Synthetic, world_size: int
) -> None:
    wrapping = data.draw(wrappings(model, world_size), label="wrapping")
    full = full_state_dict(model, world_size)
    by_position = [sorted(members, key=wrapping.positions.__getitem__) for members in wrapping.live_groups]
    common = {"param_positions": wrapping.positions, "trainable": wrapping.trainable(model)}
    for rank in range(world_size):
        layout = wrapping.layout(model, rank)
        derived = shard_full_state(layout, full, members=None, **common)
        explicit = shard_full_state(layout, full, members=by_position, **common)
        assert_identical(derived, explicit, f"rank {rank}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
