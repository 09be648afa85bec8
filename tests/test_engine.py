"""The one engine (issue "One engine"): every entry point checks a source once, into one plan.

- A full dict resharded offline to W ranks, or scattered from one rank to W ranks, is checked by
  exactly one :func:`fsdp_optim.plan.plan` call and adapted by one ``full_dict_source`` call, not once
  per destination rank. Shown by counting calls with ``unittest.mock.patch(..., wraps=...)`` around our
  own functions: a call counter on the real code, nothing replaced (real files, real processes).
- The planner reports every problem it finds in one error, each naming the parameter.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import _models as M
import pytest
import torch
from _checks import assert_identical
from _dist import run_ranks

from fsdp_optim import consolidate, reshard, scatter_full_optim_state
from fsdp_optim.core import execute as execute_module
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import plan
from fsdp_optim.formats import fullstate
from fsdp_optim.formats.fullstate import FORMAT_KEY, FORMAT_VERSION, full_dict_source
from fsdp_optim.formats.sharded.manifest import Manifest

SHAPES = {"a.w": (3, 5), "a.b": (5,), "b.w": (7,)}


@contextlib.contextmanager
def _counting(fn: Callable) -> Iterator[mock.Mock]:
    """One call counter around our own ``fn`` wherever the package's modules hold it (each imports it from the module
    that defines it), the real function called through it."""
    counter = mock.Mock(wraps=fn)
    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("fsdp_optim") and getattr(module, fn.__name__, None) is fn:
                stack.enter_context(mock.patch.object(module, fn.__name__, counter))
        yield counter


def _layout() -> ModelLayout:
    """Two units: ``a`` flattens a.w and a.b (20 elements), ``b`` holds b.w, both over 2 ranks."""
    a = FlatParamLayout("a", (ParamSpec("a.w", (3, 5), 0), ParamSpec("a.b", (5,), 15)), 2, 0, torch.float32, True)
    b = FlatParamLayout("b", (ParamSpec("b.w", (7,), 0),), 2, 0, torch.float32, True)
    return ModelLayout((a, b), tuple(SHAPES), 2, 0)


def _full() -> dict:
    torch.manual_seed(0)
    state = {
        pid: {"step": torch.tensor(3.0), "exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape)}
        for pid, shape in enumerate(SHAPES.values())
    }
    meta = {"version": FORMAT_VERSION, "optimizer": "Adam", "world_size": 2, "scalar_keys": ["step"]}
    groups = [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1, 2]}]
    return {"state": state, "param_groups": groups, "param_names": dict(enumerate(SHAPES)), FORMAT_KEY: meta}


def test_offline_reshard_of_a_full_dict_plans_once_for_every_rank(tmp_path) -> None:
    full = _full()
    given = copy.deepcopy(full)
    layout = Manifest.from_layout(_layout(), save_id="layout")
    with _counting(plan) as planned, _counting(full_dict_source) as adapted:
        reshard(full, 4, tmp_path / "out", layout=layout)
    assert (planned.call_count, adapted.call_count) == (1, 1)
    assert_identical(full, given, "the caller's dict")
    back = consolidate(tmp_path / "out")
    for pid, entries in full["state"].items():
        assert_identical(back["state"][pid], entries, f"param {pid}")


def test_the_planner_reports_every_problem_at_once() -> None:
    full = _full()
    full["state"][0]["exp_avg"] = torch.zeros(5, 3)  # a.w: transposed
    full["state"][2]["exp_avg_sq"] = full["state"][2]["exp_avg_sq"].double()  # b.w: wrong dtype
    with pytest.raises(ValueError) as raised:
        plan(full_dict_source(full), _layout())
    message = str(raised.value)
    assert len(raised.value.errors) == 2, raised.value.errors  # type: ignore[attr-defined]
    for text in ("'exp_avg' of parameter 'a.w'", "(5, 3)", "'exp_avg_sq' of parameter 'b.w'", "float64"):
        assert text in message, message


def test_a_plan_is_frozen_and_names_its_source() -> None:
    the_plan = plan(full_dict_source(_full()), _layout())
    assert the_plan.source.label == "the full dict" and not the_plan.identity
    assert [g.flat_indices for g in the_plan.groups] == [(0, 1)]
    with pytest.raises(AttributeError):
        the_plan.identity = True  # type: ignore[misc]


def _scatter_counting(rank: int, world_size: int) -> dict:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(root))
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    full = root.gather_full_optim_state_dict(optim, recipient_rank=0)
    fresh = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(root))
    with _counting(plan) as planned, _counting(full_dict_source) as adapted:
        scatter_full_optim_state(root, fresh, full if rank == 0 else None, src_rank=0)
    return {"plans": planned.call_count, "sources": adapted.call_count, "loaded": fresh.state_dict(), "own": optim.state_dict()}


def test_scatter_plans_once_on_the_source_rank_only() -> None:
    results = run_ranks(_scatter_counting, 3)
    assert [(r["plans"], r["sources"]) for r in results] == [(1, 1), (0, 0), (0, 0)]
    for rank, r in enumerate(results):
        assert_identical(r["loaded"]["state"], r["own"]["state"], f"rank {rank}")


def test_engine_modules_exist_once() -> None:
    # The parallel paths the engine replaced are gone, not kept beside it.
    assert not hasattr(fullstate, "_check_membership") and not hasattr(fullstate, "GroupSpec")
    assert hasattr(execute_module, "cut_rank") and hasattr(execute_module, "assemble_full")


def test_checksums_are_xxh3_and_earlier_sha256_digests_still_verify() -> None:
    from fsdp_optim.core.checksums import digest, digest_matches

    value = {"exp_avg": torch.arange(10.0), "step": torch.tensor(3.0), "name": "a.w"}
    assert digest(value).startswith("xxh3-128:")
    assert digest_matches(value, digest(value)) and digest_matches(value, digest(value, "sha256"))
    changed = {**value, "step": torch.tensor(4.0)}
    assert not digest_matches(changed, digest(value)) and not digest_matches(changed, digest(value, "sha256"))
    assert not digest_matches(value, "md5:" + digest(value).partition(":")[2])  # unknown algorithm: refused
    assert not digest_matches(value, None)
