"""Assertions shared by the multi-process tests (run inside the ranks)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch


def snapshot(optim_state: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of an optimizer state dict, to prove later that nothing changed."""
    return copy.deepcopy(dict(optim_state))


def assert_identical(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical: same structure, same types, tensors equal with the same dtype and shape."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{where}: tensor vs {type(a).__name__}/{type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b) if isinstance(b, Mapping) else b}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def assert_full_matches_plain(
    full: Mapping[str, Any],
    plain: Mapping[str, Any],
    *,
    skip: Callable[[str], bool] = lambda name: False,
    rel: float = 1e-5,
) -> None:
    """``full`` (gathered) equals a plain optimizer's ``state_dict()`` over the unwrapped model.

    Ids, param groups and state keys must be identical; tensors equal in dtype and shape and close
    within ``rel`` times the reference tensor's largest magnitude; scalars (``step``) exact.
    Parameters for which ``skip(name)`` holds are not compared.
    """
    names = full["param_names"]
    assert full["param_groups"] == plain["param_groups"], (full["param_groups"], plain["param_groups"])
    ours = {pid for pid in full["state"] if not skip(names[pid])}
    theirs = {pid for pid in plain["state"] if not skip(names[pid])}
    assert ours == theirs, f"state ids differ: only ours {sorted(ours - theirs)}, only plain {sorted(theirs - ours)}"
    for pid in ours:
        got, want = full["state"][pid], plain["state"][pid]
        assert list(got) == list(want), f"{names[pid]}: keys {list(got)} vs {list(want)}"
        for key, value in want.items():
            where = f"{names[pid]}[{key}]"
            if torch.is_tensor(value) and value.dim() > 0:
                assert got[key].dtype == value.dtype and got[key].shape == value.shape, where
                atol = rel * float(value.abs().max()) + 1e-12  # relative to the tensor's scale
                torch.testing.assert_close(got[key], value, rtol=rel, atol=atol, msg=lambda m: f"{where}: {m}")
            else:
                assert_identical(got[key], value, where)


def assert_unchanged(before: Mapping[str, Any], optim: torch.optim.Optimizer) -> None:
    assert_identical(before, snapshot(optim.state_dict()), "optimizer state")


def assert_fsdp2_matches_plain(
    final: Mapping[str, Any], net: Any, plain: Any, *, names: Mapping[int, str], skip: Callable[[str], bool], rel: float
) -> None:
    """An FSDP2 run's full ``{"model", "optim"}`` (optimizer keyed by name, as DCP gives it) equals plain
    training: the model within ``rel`` of ``net``, the optimizer as :func:`assert_full_matches_plain` says.
    ``names`` maps the plain optimizer's ids to parameter names; parameters where ``skip`` holds are skipped."""
    for key, value in net.state_dict().items():
        if not skip(key):
            atol = rel * float(value.abs().max())
            torch.testing.assert_close(final["model"][key], value, rtol=rel, atol=atol, msg=lambda m: f"{key}: {m}")
    expected_groups = plain.state_dict()["param_groups"]
    for got, want in zip(final["optim"]["param_groups"], expected_groups, strict=True):
        assert got["params"] == [names[i] for i in want["params"]]
        # DCP hands tuples back as lists (betas); the values must be the same.
        hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in got.items() if k != "params"}
        assert hyper == {k: v for k, v in want.items() if k != "params"}
    index = {n: i for i, n in names.items()}
    state = {index[n]: entries for n, entries in final["optim"]["state"].items() if not skip(n)}
    ours = {"state": state, "param_groups": expected_groups, "param_names": names}
    assert_full_matches_plain(ours, plain.state_dict(), skip=skip, rel=rel)


def loads_old_fixture_exactly(rank: int, world_size: int, fixture: str) -> bool:
    """(A rank of ``run_ranks``.) The optimizer-only checkpoint ``fixture/ckpt`` of an older format loads, at the saved
    layout (each rank reads its own file) and re-cut, into an optimizer that had stepped, exactly as the shard of the
    fixture's ``full.pt``."""
    import os

    import _models as M

    import fsdp_optim

    full = torch.load(os.path.join(fixture, "full.pt"), weights_only=True)
    for nesting in ("deep", "shallow"):
        root = M.wrap(M.make_net(), nesting)
        optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
        M.train_step(root, optim, *M.local_batch(7, rank, world_size))  # a state that the load must replace
        fsdp_optim.load_sharded_optim_state(root, optim, os.path.join(fixture, "ckpt"))
        assert_identical(optim.state_dict(), root.get_shard_from_optim_state_dict(full, optim=optim), nesting)
    return True
