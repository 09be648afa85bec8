"""Bad inputs are refused with a clear error and change nothing (the in-memory kinds).

One spawn at world size 2 trains the test model (real gloo, real fairscale FSDP, real Adam steps),
gathers the full dict on every rank, then tries every case in ``CASES`` on every rank and records the
outcome: the exception's type and message, whether the input dict is still equal to a deep copy taken
before the call, and whether the live optimizer's state is unchanged. One pytest test per case reads
those outcomes through the module-scoped ``outcomes`` fixture.

A case is a function ``(ctx) -> Attempt`` registered with ``@refusal(error, *mentions)``: ``mentions``
are the texts the message must contain, namely the parameter's fully qualified unwrapped name (or the
argument's name) and what was expected and found.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from _checks import assert_identical, snapshot
from _dist import run_ranks
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP

WORLD_SIZE = 2
CONTROL = "unedited"
STEPS = 2  # so every state entry has "step" == 2.0


@dataclass
class Context:
    """What every case starts from, on one rank."""

    rank: int
    model: FSDP
    optim: torch.optim.Optimizer  # Adam over the model's two param groups, after STEPS steps
    full: dict[str, Any]  # its gathered full dict (never handed to a case: each gets a deep copy)
    # The same model with its root sharded over 1 rank and block2.inner over 2; built before the cases
    # run because creating its process groups is collective.
    solo_root: FSDP

    def fresh_full(self) -> dict[str, Any]:
        return copy.deepcopy(self.full)

    def adam(self, groups: Any = None) -> torch.optim.Optimizer:
        return torch.optim.Adam(M.fsdp_param_groups(self.model) if groups is None else groups, lr=0.01)


@dataclass
class Attempt:
    call: Callable[[], Any]
    given: Any = None  # the caller's dict, which must be left as it was
    optim: torch.optim.Optimizer | None = None  # the live optimizer involved, if not ctx.optim


Make = Callable[[Context], Attempt]


@dataclass(frozen=True)
class Refusal:
    make: Make
    error: type[Exception] | tuple[type[Exception], ...]
    mentions: tuple[str, ...]

    @property
    def error_names(self) -> tuple[str, ...]:
        return tuple(e.__name__ for e in (self.error if isinstance(self.error, tuple) else (self.error,)))


CASES: dict[str, Refusal] = {}


def refusal(error: type[Exception] | tuple[type[Exception], ...], *mentions: str) -> Callable[[Make], Make]:
    """Register the decorated case under its function name."""

    def register(make: Make) -> Make:
        CASES[make.__name__] = Refusal(make, error, mentions)
        return make

    return register


# --- editing a full dict ---------------------------------------------------------------------------


def pid(full: dict[str, Any], name: str) -> int:
    return next(i for i, n in full["param_names"].items() if n == name)


def drop(full: dict[str, Any], name: str) -> None:
    i = pid(full, name)
    full["state"].pop(i, None)
    del full["param_names"][i]
    for group in full["param_groups"]:
        if i in group["params"]:
            group["params"].remove(i)


def move(full: dict[str, Any], name: str, to_group: int) -> None:
    i = pid(full, name)
    for group in full["param_groups"]:
        if i in group["params"]:
            group["params"].remove(i)
    full["param_groups"][to_group]["params"].append(i)


def load(ctx: Context, full: Any, optim: torch.optim.Optimizer | None = None) -> Attempt:
    """Attempt to cut ``full`` for the live optimizer (``ctx.optim`` unless given)."""
    optim = optim or ctx.optim
    return Attempt(lambda: ctx.model.get_shard_from_optim_state_dict(full, optim=optim), given=full, optim=optim)


BLOCK1 = ("block1.0.weight", "block1.0.bias", "block1.2.weight", "block1.2.bias")  # one flat parameter


# --- the catalogue -----------------------------------------------------------------------------------


@refusal(ValueError, "'block1.2.bias'", "missing", "'block1.0.weight'")
def missing_parameter(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    drop(full, "block1.2.bias")
    return load(ctx, full)


@refusal(ValueError, "'block1.0.weight'", "missing")
def missing_unit(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    for name in BLOCK1:
        drop(full, name)
    return load(ctx, full)


@refusal(ValueError, "'block1.4.weight'", "does not have")
def extra_parameter(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    new = max(full["param_names"]) + 1
    full["param_names"][new] = "block1.4.weight"
    full["param_groups"][0]["params"].append(new)
    full["state"][new] = {key: v.clone() for key, v in full["state"][pid(full, "block1.0.weight")].items()}
    return load(ctx, full)


@refusal(ValueError, "'exp_avg'", "'block2.inner.a.weight'", "(5, 4)", "(5, 5)")
def wrong_shape(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["state"][pid(full, "block2.inner.a.weight")]["exp_avg"] = torch.zeros(5, 4)
    return load(ctx, full)


@refusal(ValueError, "'exp_avg_sq'", "'block1.0.weight'", "(6, 7)", "(7, 6)")
def transposed_shape_same_numel(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    state = full["state"][pid(full, "block1.0.weight")]
    state["exp_avg_sq"] = state["exp_avg_sq"].t().contiguous()
    return load(ctx, full)


@refusal(ValueError, "'exp_avg'", "'block1.0.weight'", "()", "(7, 6)")
def zero_dim_where_per_element_state_expected(ctx: Context) -> Attempt:
    # The dict's header lists only "step" as scalar; a 0-dim "exp_avg" across a whole unit is a wrong shape.
    full = ctx.fresh_full()
    for name in BLOCK1:
        full["state"][pid(full, name)]["exp_avg"] = torch.tensor(0.0)
    return load(ctx, full)


@refusal(ValueError, "'exp_avg_sq'", "'norm.weight'", "torch.float64", "torch.float32")
def wrong_dtype(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    state = full["state"][pid(full, "norm.weight")]
    state["exp_avg_sq"] = state["exp_avg_sq"].double()
    return load(ctx, full)


@refusal(ValueError, "'block1.2.bias'", "group 1", "group 0")
def param_group_splits_a_unit(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    move(full, "block1.2.bias", 1)
    return load(ctx, full)


@refusal(ValueError, "'block2.proj.bias'", "'exp_avg_sq'", "'block2.proj.weight'")
def state_key_missing_for_one_parameter_of_a_unit(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    del full["state"][pid(full, "block2.proj.bias")]["exp_avg_sq"]
    return load(ctx, full)


@refusal(ValueError, "'block2.inner.b.bias'", "no optimizer state", "'block2.inner.a.weight'")
def state_missing_for_one_parameter_of_a_unit(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    del full["state"][pid(full, "block2.inner.b.bias")]
    return load(ctx, full)


@refusal(ValueError, "'step'", "'block1.0.weight'", "'block1.2.weight'", "2.0", "3.0")
def scalar_state_differs_inside_a_unit(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["state"][pid(full, "block1.2.weight")]["step"] += 1
    return load(ctx, full)


@refusal(ValueError, "optim", "Adam", "AdamW")
def different_optimizer_class(ctx: Context) -> Attempt:
    return load(ctx, ctx.fresh_full(), torch.optim.AdamW(M.fsdp_param_groups(ctx.model), lr=0.01))


@refusal(ValueError, "version 2", "up to 1")
def newer_format_version(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["fsdp_optim"]["version"] = 2
    return load(ctx, full)


@refusal((TypeError, ValueError), "fsdp_optim", "dict", "str")
def format_header_not_a_dict(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["fsdp_optim"] = "version 1"
    return load(ctx, full)


@refusal(TypeError, "expected a dict", "list")
def not_a_dict(ctx: Context) -> Attempt:
    return load(ctx, [ctx.fresh_full()])


@refusal(ValueError, "'state'", "embed.weight")
def a_model_state_dict_instead(ctx: Context) -> Attempt:
    net = M.make_net()
    return load(ctx, net.state_dict())


@refusal(ValueError, "'param_names'")
def plain_optimizer_state_dict_without_names(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    del full["param_names"], full["fsdp_optim"]
    return load(ctx, full)


@refusal(ValueError, "'block1.0.weight'", "twice")
def a_name_given_twice(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["param_names"][pid(full, "block1.2.weight")] = "block1.0.weight"
    return load(ctx, full)


@refusal(ValueError, "param group 1", "id 99", "'param_names'")
def a_group_lists_an_unnamed_id(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["param_groups"][1]["params"].append(99)
    return load(ctx, full)


@refusal(ValueError, "state for id 99", "no param group")
def state_for_an_id_no_group_lists(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    full["state"][99] = copy.deepcopy(full["state"][pid(full, "norm.bias")])
    return load(ctx, full)


@refusal(ValueError, "1 param groups", "2")
def wrong_number_of_param_groups(ctx: Context) -> Attempt:
    return load(ctx, ctx.fresh_full(), ctx.adam(list(ctx.model.parameters())))


@refusal(ValueError, "'block1.0.weight'", "group 1 of the full dict", "group 0 of the optimizer")
def param_group_membership_differs_from_optimizer(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    for name in BLOCK1:
        move(full, name, 1)
    return load(ctx, full)


@refusal(ValueError, "shape (3, 3)", "does not own")
def optimizer_holds_a_foreign_parameter_on_load(ctx: Context) -> Attempt:
    groups = M.fsdp_param_groups(ctx.model)
    groups[0]["params"].append(nn.Parameter(torch.zeros(3, 3)))
    return load(ctx, ctx.fresh_full(), ctx.adam(groups))


@refusal(ValueError, "'block2.inner", "2 ranks", "over 1")
def nested_unit_with_incompatible_world_size(ctx: Context) -> Attempt:
    full = ctx.fresh_full()
    return Attempt(lambda: ctx.solo_root.get_shard_from_optim_state_dict(full), given=full)


# Gathers: every rank refuses alike, before any collective, so none is left waiting.


def gather(ctx: Context, optim: torch.optim.Optimizer | None = None, **kwargs: Any) -> Attempt:
    optim = optim or ctx.optim
    return Attempt(lambda: ctx.model.gather_full_optim_state_dict(optim, **kwargs), optim=optim)


@refusal(ValueError, "recipient_rank", "[0, 2)", "2")
def recipient_rank_out_of_range(ctx: Context) -> Attempt:
    return gather(ctx, recipient_rank=2)


@refusal(ValueError, "recipient_rank", "'0'")
def recipient_rank_not_an_int(ctx: Context) -> Attempt:
    return gather(ctx, recipient_rank="0")


@refusal(ValueError, "transport", "'pickle'")
def unknown_transport(ctx: Context) -> Attempt:
    return gather(ctx, transport="pickle")


@refusal(ValueError, "shape (3, 3)", "does not own")
def optimizer_holds_a_foreign_parameter_on_gather(ctx: Context) -> Attempt:
    groups = M.fsdp_param_groups(ctx.model)
    groups[0]["params"].append(nn.Parameter(torch.zeros(3, 3)))
    return gather(ctx, ctx.adam(groups))


@refusal(ValueError, "root")
def gather_on_a_nested_instance(ctx: Context) -> Attempt:
    return Attempt(lambda: ctx.model.module.block2.gather_full_optim_state_dict(ctx.optim), optim=ctx.optim)


@refusal(ValueError, "'step'", "block1.0.weight", "differs across ranks", "rank 0 has", "2.0", "rank 1 has", "3.0")
def ranks_disagree_on_a_scalar(ctx: Context) -> Attempt:
    # A copy of the optimizer in which rank 1 took one more step on block1's flat parameter than rank 0.
    optim = ctx.adam()
    optim.load_state_dict(copy.deepcopy(ctx.optim.state_dict()))
    if ctx.rank == 1:
        flat = next(p for p in ctx.model.module.block1.params)
        optim.state[flat]["step"] += 1
    return gather(ctx, optim)


# --- running the catalogue inside the ranks ----------------------------------------------------------


def _solo_root_model() -> FSDP:
    """The test model whose root is sharded over 1 rank while ``block2.inner`` is sharded over the world."""
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes every group
    mine = solo[dist.get_rank()]
    net = M.make_net()
    net.block2.inner = FSDP(net.block2.inner, flatten_parameters=True)
    net.frozen = FSDP(net.frozen, process_group=mine, flatten_parameters=True)  # frozen params need a unit of their own
    return FSDP(net, process_group=mine, flatten_parameters=True)


def _try(ctx: Context, case: Refusal) -> dict[str, Any]:
    attempt = case.make(ctx)
    given_before = copy.deepcopy(attempt.given)
    live = [ctx.optim] + ([attempt.optim] if attempt.optim not in (None, ctx.optim) else [])
    live_before = [snapshot(o.state_dict()) for o in live]
    outcome: dict[str, Any] = {"error": None, "message": ""}
    try:
        attempt.call()
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        outcome = {"error": type(e).__name__, "message": str(e), "where": traceback.format_exc(limit=-2)}
    outcome["input_changed"] = _difference(attempt.given, given_before)
    outcome["optim_changed"] = next(
        (d for o, before in zip(live, live_before) if (d := _difference(snapshot(o.state_dict()), before))), None
    )
    return outcome


def _difference(now: Any, before: Any) -> str | None:
    try:
        assert_identical(now, before, "input")
    except AssertionError as e:
        return str(e)
    return None


def _check_every_case(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    model = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    for step in range(STEPS):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    full = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    ctx = Context(rank, model, optim, full, _solo_root_model())
    outcomes = {name: _try(ctx, case) for name, case in CASES.items()}
    # Controls: unedited, the same dict loads and the same gather runs (so each case fails for its own reason).
    outcomes[CONTROL] = _try(ctx, Refusal(lambda c: load(c, c.fresh_full()), Exception, ()))
    outcomes[CONTROL + " gather"] = _try(ctx, Refusal(lambda c: gather(c, recipient_rank=1), Exception, ()))
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_check_every_case, WORLD_SIZE)


# Bugs found by this catalogue (refused unclearly or not at all) stay here, strict xfail, until fixed.
KNOWN_BUGS: dict[str, str] = {}  # kind -> description, for bugs found and not yet fixed


def _kinds() -> list[Any]:
    xfail = {k: pytest.mark.xfail(strict=True, reason=reason) for k, reason in KNOWN_BUGS.items()}
    return [pytest.param(k, marks=xfail[k]) if k in xfail else k for k in CASES]


@pytest.mark.parametrize("kind", _kinds())
def test_refused_clearly_and_nothing_changes(kind: str, outcomes: list[dict[str, dict[str, Any]]]) -> None:
    case = CASES[kind]
    for rank, per_rank in enumerate(outcomes):
        got = per_rank[kind]
        assert got["error"] in case.error_names, f"rank {rank}: expected {' or '.join(case.error_names)}, got {got}"
        missing = [text for text in case.mentions if text not in got["message"]]
        assert not missing, f"rank {rank}: message lacks {missing}: {got['message']!r}"
        assert got["input_changed"] is None, f"rank {rank}: the input dict changed: {got['input_changed']}"
        assert got["optim_changed"] is None, f"rank {rank}: the optimizer changed: {got['optim_changed']}"


@pytest.mark.parametrize("control", [CONTROL, CONTROL + " gather"])
def test_controls_succeed(control: str, outcomes: list[dict[str, dict[str, Any]]]) -> None:
    for rank, per_rank in enumerate(outcomes):
        got = per_rank[control]
        assert got["error"] is None, f"rank {rank}: {got}"
        assert got["input_changed"] is None and got["optim_changed"] is None, f"rank {rank}: {got}"


def test_catalogue_covers_enough_kinds() -> None:
    assert len(CASES) >= 15, sorted(CASES)
