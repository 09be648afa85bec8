"""What every rank runs for one (model, world size): build and train, then measure every method.

1. Build the three wrappings of the same model (fsdp_optim/fairscale, PyTorch FSDP1, FSDP2) and train
   each for the same steps on the same batches. A wrapping that cannot be built here is reported n/a.
2. Gathers, interleaved: floors, ours, ours_object, fairscale, fsdp1, fsdp2.
3. Loading, interleaved: ``get_shard_from_optim_state_dict`` against a fresh copy of the shard's bytes,
   from a full dict that every rank holds (what each rank has after loading a checkpoint file).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .. import models
from ..ckpt.common import Job, phase
from ..measure import Measurement, Method, NotAvailable, first_error, measure, release_memory
from . import checks, floors, peers


@dataclass(frozen=True)
class RunConfig(Job):
    methods: tuple[str, ...]
    device_type: str  # "cpu" or "cuda"


def _device(cfg: RunConfig) -> torch.device:
    if cfg.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_all(rank: int, world_size: int, cfgs: list[RunConfig]) -> list[dict[str, Any] | None]:
    """:func:`run` for each config in turn, in the same processes (imports cost seconds per rank)."""
    out = []
    for cfg in cfgs:
        out.append(run(rank, world_size, cfg))
        release_memory()
    return out


def _gathers(
    cfg: RunConfig,
    setups: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
    shards: floors.Shards,
    sync: Callable[[], None] | None,
) -> dict[str, Measurement | NotAvailable] | None:
    """Every gather and gather floor, interleaved; results checked against ours."""
    model, optim = setups["fairscale"]
    reference: dict[str, checks.Fingerprint] = {}

    def set_reference(result: Any) -> str:
        reference["ours"] = checks.fingerprint(result)
        return checks.compare(result, None, checks.storages(optim))

    def check_with(live_optim: torch.optim.Optimizer) -> Callable[[Any], str]:
        return lambda result: checks.compare(result, reference.get("ours"), checks.storages(live_optim))

    gather_buffers = floors.gather_buffers(shards)
    warm, staging = floors.warm_buffers(shards)
    methods = {  # "ours" first: round 0 runs in this order and its result is the reference
        "ours": replace(peers.ours(model, optim), check=set_reference),
        "ours_object": replace(peers.ours_object(model, optim), check=check_with(optim)),
        "fairscale": replace(peers.fairscale(model, optim), check=check_with(optim)),
        "floor_gather": Method(lambda: floors.gather(shards, gather_buffers)),
        "floor_p2p_warm": Method(lambda: floors.p2p(shards, warm, staging)),
        "floor_p2p_fresh": Method(lambda: floors.p2p(shards, None, staging)),
    }
    for name, make in (("fsdp1", peers.fsdp1), ("fsdp2", peers.fsdp2)):
        if name in setups:
            methods[name] = replace(make(*setups[name]), check=check_with(setups[name][1]))
    wanted = {k: v for k, v in methods.items() if k in cfg.methods}
    return measure(wanted, warmup=cfg.warmup, repeats=cfg.repeats, sync=sync)


def _loads(
    cfg: RunConfig,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    shards: floors.Shards,
    sync: Callable[[], None] | None,
) -> dict[str, Measurement | NotAvailable] | None:
    """get_shard_from_optim_state_dict against a fresh copy, from a full dict every rank holds."""
    full = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    methods = {"get_shard": peers.get_shard(model, optim, full), "floor_copy": Method(lambda: floors.copy(shards))}
    wanted = {k: v for k, v in methods.items() if k in cfg.methods}  # dict order: the same on every rank
    return measure(wanted, warmup=cfg.warmup, repeats=cfg.repeats, sync=sync)


def run(rank: int, world_size: int, cfg: RunConfig) -> dict[str, Any] | None:
    """Measure every wanted method for ``cfg.model`` at this world size; the results on rank 0."""
    device = _device(cfg)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    wanted = set(cfg.methods)
    timings: dict[str, float] = {}
    unavailable: dict[str, NotAvailable] = {}

    setups: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    wrappings = (("fairscale", models.wrap_fairscale), ("fsdp1", models.wrap_fsdp1), ("fsdp2", models.wrap_fsdp2))
    for name, wrap in wrappings:
        if name != "fairscale" and name not in wanted:
            continue
        with phase(timings, f"build_train_{name}_s"):
            error = ""
            try:
                setups[name] = cfg.build(wrap, rank, device)
            except Exception as exc:  # a framework that cannot run here is reported, not dropped silently
                error = f"setup failed: {type(exc).__name__}: {exc}"[:200]
                traceback.print_exc()
            error = first_error(error)
            if error:
                setups.pop(name, None)
                unavailable[name] = NotAvailable(error)
    if "fairscale" not in setups:
        raise RuntimeError(f"fsdp_optim's FSDP could not be set up: {unavailable['fairscale'].reason}")
    model, optim = setups["fairscale"]
    shards = floors.Shards.of(model, optim)

    with phase(timings, "gathers_s"):
        results = _gathers(cfg, setups, shards, sync)
    for name in ("fsdp1", "fsdp2"):
        setups.pop(name, None)
    release_memory()
    if "get_shard" in wanted or "floor_copy" in wanted:
        with phase(timings, "loads_s"):
            loaded = _loads(cfg, model, optim, shards, sync)
        if results is not None and loaded is not None:
            results.update(loaded)

    if rank != 0:
        return None
    assert results is not None, "rank 0 is the recipient and must hold the results"
    for name, value in unavailable.items():
        if name in wanted:
            results[name] = value
    return {"full_bytes": shards.full_bytes, "results": results, "timings": timings}


__all__ = ["Measurement", "NotAvailable", "RunConfig", "run", "run_all"]
