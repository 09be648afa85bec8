"""``job.root.verify_root``: the one reader of a fairscale FSDP root, on a real nested FSDP model over 2 gloo ranks.

It returns a typed :class:`Root` whose layout, live parameters, positions, process group, rank, world size and
optimizer members match the model (each checked against what fairscale itself holds), and it refuses a nested
instance, a module that is not FSDP, and an optimizer over parameters the root does not own, clearly.
"""

from __future__ import annotations

import dataclasses

import _models as M
import pytest
import torch
from _dist import run_ranks
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP
from fsdp_optim.job.root import Root, verify_root

WORLD_SIZE = 2
UNITS = ["", "block1", "block2", "block2.inner", "frozen"]  # FSDP-instance (named_modules) order, "deep" nesting


def _check_record(rank: int, world_size: int) -> object:
    root = M.wrap(M.make_net(), "deep")
    optim = torch.optim.Adam(M.fsdp_param_groups(root), lr=0.01)
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))  # after a forward, nested units know they are

    record = verify_root(root, optim)
    assert isinstance(record, Root)
    assert (record.rank, record.world_size) == (rank, world_size)
    assert record.group is root.process_group
    layout = record.layout
    assert (layout.rank, layout.world_size) == (rank, world_size)
    assert [f.unit for f in layout.flat_params] == UNITS
    assert all((f.world_size, f.rank, f.per_rank) == (world_size, rank, False) for f in layout.flat_params)

    # The live parameters are fairscale's own objects, in the layout's order, each this rank's padded shard.
    fairscale_params = [p for m in root.modules() if isinstance(m, FSDP) for p in m.params]
    assert len(record.params) == len(layout.flat_params) == len(UNITS)
    assert all(mine is theirs for mine, theirs in zip(record.params, fairscale_params, strict=True))
    for flat, param in zip(layout.flat_params, record.params):
        assert param.numel() == flat.bounds().numel, flat.describe()

    # The layout names every parameter of the unwrapped model once, in its order, with its shape.
    plain = M.make_net()
    assert layout.param_order == tuple(n for n, _ in plain.named_parameters())
    shapes = {spec.name: spec.shape for f in layout.flat_params for spec in f.params}
    assert shapes == {n: tuple(p.shape) for n, p in plain.named_parameters()}

    everything = list(root.parameters())
    assert record.positions == tuple(next(i for i, q in enumerate(everything) if q is p) for p in record.params)
    index = {id(p): i for i, p in enumerate(record.params)}
    assert record.members == tuple(tuple(index[id(p)] for p in g["params"]) for g in optim.param_groups)
    assert record.members == ((0, 1, 4), (2, 3))  # block2 and block2.inner make param group 1

    assert verify_root(root).members is None  # without an optimizer
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.rank = 5  # type: ignore[misc]
    return layout.at_rank(0)


def _check_refusals(rank: int, world_size: int) -> None:
    root = M.wrap(M.make_net(), "deep")
    optim = torch.optim.Adam(M.fsdp_param_groups(root), lr=0.01)
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))

    for nested in (root.module.block1, root.module.block2, root.module.block2.inner):
        assert isinstance(nested, FSDP)
        with pytest.raises(ValueError, match="expected the root FSDP instance, found a nested one; call this on the root"):
            verify_root(nested, optim)
    for other in (M.make_net(), nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=f"expected a fairscale FullyShardedDataParallel root, found {type(other).__name__}"):
            verify_root(other)
    with pytest.raises(TypeError, match="found NoneType"):
        verify_root(None)
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 holds a parameter of shape \(3,\) that this FSDP instance does not own"):
        verify_root(root, stranger)


def test_verify_root_reads_a_nested_root() -> None:
    layouts = run_ranks(_check_record, WORLD_SIZE)
    assert layouts[0] == layouts[1]  # every rank reads the same layout, up to its own rank


def test_verify_root_refuses_what_is_not_a_root() -> None:
    run_ranks(_check_refusals, WORLD_SIZE)
