"""Faithful data: NaN and Inf bit for bit on every path, no autograd history in any output, and
shape-dependent optimizers refused on every path. One world-size-2 job on real gloo and fairscale FSDP.

- **NaN/Inf.** Adam's state gets NaN (two payloads), +Inf, -Inf and -0.0 in ``exp_avg`` and a NaN
  ``step``; gather, get_shard, save + load (same and another world size, via ``reshard``), consolidate,
  scatter from a file and ``to_named`` must all give the same bits back (compared as raw bytes, since
  NaN != NaN), and nothing may refuse the state (a NaN ``step`` used to fail the scalar comparison).
- **Autograd.** Inputs that require grad (a full dict with grad-requiring and grad_fn-carrying tensors,
  an optimizer whose state and ``lr`` require grad, a rank file holding ``nn.Parameter`` state) give
  outputs none of whose tensors requires grad or has a ``grad_fn``: gather, get_shard, scatter,
  consolidate, reshard, ``to_named``.
- **Shape-dependent optimizers.** ``torch.optim.Adafactor`` is refused by gather, save, get_shard (with
  and without ``optim``), load and scatter, on every rank, naming the optimizer and a state key, with
  nothing written and the optimizer unchanged; an elementwise optimizer of the user's own class is
  refused until declared with ``register_elementwise_optimizer``, then works.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import fsdp_optim
from fsdp_optim import (
    consolidate,
    load_sharded_optim_state,
    reshard,
    save_sharded_optim_state,
    scatter_full_optim_state,
    to_named,
)

WORLD_SIZE = 2
PAYLOAD_NAN = 0x7FC0_0001  # a quiet NaN with a payload: == would not even tell it from the default NaN


def _bits(value: Any) -> Any:
    """A comparable form that tells every bit: tensors as (dtype, shape, raw bytes)."""
    if torch.is_tensor(value):
        t = value.detach().contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()))
    if isinstance(value, Mapping):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_bits(v) for v in value)
    if isinstance(value, float):
        return ("float", value.hex())
    return value


def _grad_carriers(value: Any, where: str = "") -> list[str]:
    """Where ``value`` holds a tensor that requires grad or has a grad_fn."""
    if torch.is_tensor(value):
        return [where] if value.requires_grad or value.grad_fn is not None else []
    if isinstance(value, Mapping):
        return [w for k, v in value.items() for w in _grad_carriers(v, f"{where}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [w for i, v in enumerate(value) for w in _grad_carriers(v, f"{where}[{i}]")]
    return []


def _trained(optimizer: str = "adam", cls: Any = None) -> tuple[Any, torch.optim.Optimizer]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = M.wrap(M.make_net(), "deep")
    optim = cls(M.fsdp_param_groups(model), lr=0.01) if cls is not None else M.OPTIMIZERS[optimizer](M.fsdp_param_groups(model))
    for step in range(2):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    return model, optim


def _poison(optim: torch.optim.Optimizer) -> None:
    """NaN (two payloads), +-Inf and -0.0 in every exp_avg, and a NaN step, the same on every rank."""
    for entries in optim.state.values():
        flat = entries["exp_avg"].view(-1)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        n = min(4, flat.numel())
        flat[:n] = specials[:n]
        if flat.numel() > 4:
            flat[4:5].view(torch.int32).fill_(PAYLOAD_NAN)
        entries["step"].fill_(float("nan"))


def _outcome(fn: Callable[[], Any]) -> tuple[str | None, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        return type(exc).__name__, f"{exc}\n{traceback.format_exc(limit=-3)}"
    return None, ""


def _job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    out = Path(out_dir)
    results: dict[str, Any] = {}

    # --- NaN and Inf, bit for bit -----------------------------------------------------------------------
    model, optim = _trained()
    _poison(optim)
    own = _bits(optim.state_dict())
    full = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    results["nan get_shard"] = _bits(model.get_shard_from_optim_state_dict(full, optim=optim)) == own
    save_sharded_optim_state(model, optim, out / "nan")
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    load_sharded_optim_state(model, fresh, out / "nan")
    results["nan save+load"] = _bits(fresh.state_dict()) == own
    if rank == 0:
        torch.save(full, out / "nan-full.pt")
        results["nan consolidate"] = _bits(consolidate(out / "nan")) == _bits(full)
        reshard(out / "nan", 3, out / "nan-ws3")
        again = consolidate(out / "nan-ws3")
        results["nan reshard"] = _bits({**again, "fsdp_optim": None}) == _bits({**full, "fsdp_optim": None})
        named = to_named(full)
        results["nan to_named"] = all(
            _bits(named["state"][full["param_names"][pid]]) == _bits(entries) for pid, entries in full["state"].items()
        )
    dist.barrier()
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    scatter_full_optim_state(model, fresh, out / "nan-full.pt" if rank == 0 else None)
    results["nan scatter"] = _bits(fresh.state_dict()) == own
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    load_sharded_optim_state(model, fresh, out / "nan-ws3")  # another world size: re-cut on load
    results["nan load at another world size"] = _bits(fresh.state_dict()) == own

    # --- no autograd history in outputs -------------------------------------------------------------------
    model, optim = _trained()
    full = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    leaf = torch.ones((), requires_grad=True)
    graded = {
        **full,
        "state": {
            pid: {k: (v.clone().requires_grad_(True) if v.dim() == 0 else v * leaf) for k, v in entries.items()}
            for pid, entries in full["state"].items()
        },
        "param_groups": [{**g, "lr": torch.tensor(g["lr"], requires_grad=True)} for g in full["param_groups"]],
    }
    results["grad get_shard"] = _grad_carriers(model.get_shard_from_optim_state_dict(graded, optim=optim))
    results["grad to_named"] = _grad_carriers(to_named(graded))
    fresh = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    scatter_full_optim_state(model, fresh, graded if rank == 0 else None)
    results["grad scatter"] = _grad_carriers(fresh.state_dict())
    for entries in optim.state.values():  # a live optimizer whose state and lr require grad
        entries["exp_avg"] = entries["exp_avg"].clone().requires_grad_(True)
    for group in optim.param_groups:
        group["lr"] = torch.tensor(group["lr"], requires_grad=True)
    results["grad gather"] = _grad_carriers(model.gather_full_optim_state_dict(optim, recipient_rank=None))
    if rank == 0:
        results["grad reshard from a dict"] = _grad_carriers(
            consolidate(reshard(graded, 2, out / "grad-ws2", layout=out / "nan"))
        )
    dist.barrier()
    if rank == 0:  # a rank file whose state tensors are nn.Parameters (they unpickle requiring grad)
        import _attacks as A

        A.to_format1(out / "nan")  # only format 1 (pickle) can hold a Parameter
        A.forge_rank_file(
            out / "nan", 1, lambda state: state.update({i: {k: torch.nn.Parameter(v) if v.dim() else v
                                                             for k, v in e.items()} for i, e in state.items()})
        )
        results["grad consolidate"] = _grad_carriers(consolidate(out / "nan"))

    # --- shape-dependent optimizers ---------------------------------------------------------------------
    model, adafactor = _trained(cls=torch.optim.Adafactor)
    before = _bits(adafactor.state_dict())
    adam_model, adam = _trained()
    adam_full = adam_model.gather_full_optim_state_dict(adam, recipient_rank=None)
    save_sharded_optim_state(adam_model, adam, out / "adam")
    header = {**adam_full, "fsdp_optim": {**adam_full["fsdp_optim"], "optimizer": "Adafactor"}}
    results["adafactor"] = {
        "gather": _outcome(lambda: model.gather_full_optim_state_dict(adafactor)),
        "save": _outcome(lambda: save_sharded_optim_state(model, adafactor, out / "adafactor")),
        "get_shard": _outcome(lambda: model.get_shard_from_optim_state_dict(adam_full, optim=adafactor)),
        "get_shard without optim": _outcome(lambda: model.get_shard_from_optim_state_dict(header)),
        "load": _outcome(lambda: load_sharded_optim_state(model, adafactor, out / "adam")),
        "scatter": _outcome(lambda: scatter_full_optim_state(model, adafactor, adam_full if rank == 0 else None)),
    }
    results["adafactor unchanged"] = _bits(adafactor.state_dict()) == before
    results["adafactor wrote"] = os.path.exists(out / "adafactor")

    class MyAdam(torch.optim.Adam):  # elementwise, but fsdp_optim cannot know that
        pass

    model, mine = _trained(cls=MyAdam)
    results["custom before"] = _outcome(lambda: model.gather_full_optim_state_dict(mine))
    fsdp_optim.register_elementwise_optimizer(MyAdam)
    results["custom after"] = _outcome(lambda: save_sharded_optim_state(model, mine, out / "mine"))
    fresh = MyAdam(M.fsdp_param_groups(model), lr=0.01)
    load_sharded_optim_state(model, fresh, out / "mine")
    results["custom round trip"] = _bits(fresh.state_dict()) == _bits(mine.state_dict())
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_job, WORLD_SIZE, str(tmp_path_factory.mktemp("faithful")))


NAN_PATHS = ["get_shard", "save+load", "scatter", "load at another world size"]
NAN_OFFLINE = ["consolidate", "reshard", "to_named"]


@pytest.mark.parametrize("path", NAN_PATHS + NAN_OFFLINE)
def test_nan_and_inf_round_trip_bit_for_bit(path: str, results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results if path in NAN_PATHS else results[:1]):
        assert r[f"nan {path}"] is True, f"rank {rank}: {path} changed the bits of NaN/Inf state"


GRAD_PATHS = ["get_shard", "to_named", "scatter", "gather"]


@pytest.mark.parametrize("path", GRAD_PATHS + ["reshard from a dict", "consolidate"])
def test_outputs_carry_no_autograd_history(path: str, results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results if path in GRAD_PATHS else results[:1]):
        assert r[f"grad {path}"] == [], f"rank {rank}: {path} returned tensors with autograd history at {r[f'grad {path}']}"


@pytest.mark.parametrize("path", ["gather", "save", "get_shard", "get_shard without optim", "load", "scatter"])
def test_shape_dependent_optimizer_is_refused_naming_it_and_a_state_key(path: str, results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        error, message = r["adafactor"][path]
        assert error in ("NotElementwiseError", "NotImplementedError"), f"rank {rank}: {path}: {error}: {message}"
        assert "Adafactor" in message and "register_elementwise_optimizer" in message, message
        if path not in ("get_shard without optim", "scatter") or rank == 0:
            assert "state keys [" in message and "'step'" in message, f"rank {rank}: {path}: {message}"
        assert r["adafactor unchanged"] and not r["adafactor wrote"], f"rank {rank}"


def test_a_declared_elementwise_optimizer_is_accepted(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        error, message = r["custom before"]
        assert error == "NotElementwiseError" and "MyAdam" in message and "not known to be elementwise" in message
        assert r["custom after"] == (None, ""), f"rank {rank}: {r['custom after']}"
        assert r["custom round trip"], f"rank {rank}"
