"""fairseq / metaseq shard sets written by real fairscale FSDP jobs, and the jobs that resume from them.

The writer builds each rank's dict exactly as fairseq's and metaseq's ``Trainer.state_dict`` do with
``use_sharded_state`` (without depending on either) and ``torch.save``-s it as ``{prefix}-shard{rank}.pt``:

- ``model``: ``local_state_dict()`` (fairseq's FSDP returns it from ``state_dict()`` when sharded);
- ``last_optimizer_state``: ``optim.state_dict()``, plus ``loss_scale`` as fairseq's FP16 optimizers add it;
- ``shard_metadata`` (metaseq, fairseq nllb) or ``fsdp_metadata`` (fairseq main): ``local_metadata_dict()``;
- ``cfg`` (fairseq's may hold an ``argparse.Namespace``), ``criterion``, ``optimizer_history``, ``task_state``,
  ``extra_state`` (numpy scalars in its metrics), and fairseq main's legacy ``args: None``.

:func:`run_jobs` runs every job of test_fairseq.py and test_dcp.py once per pytest process (four spawns),
with the offline steps between them in the test process, and returns where everything lies.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _models as M
import numpy as np
import torch
from _dist import run_ranks

SAVE_AT, TOTAL = 2, 4
LOSS_SCALE = 64.0
# name -> how the job wraps, groups and writes it
VARIANTS: dict[str, dict[str, Any]] = {
    # flat units, two param groups, fp16-style loss_scale, metaseq's key
    "groups": {"flatten": True, "groups": True, "flavour": "metaseq", "loss_scale": LOSS_SCALE},
    # every unit unflattened, one group over root.parameters(), fairseq main's key and cfg
    "unflat": {"flatten": False, "groups": False, "flavour": "fairseq", "loss_scale": None},
}
PREFIX = "checkpoint_2-model_part-0"


class Marker:
    """A class of the tests' own: a cfg holding one is refused unless allowed by name ("_fairseq.Marker")."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


def checkpoint_dict(
    model: Any, optim: torch.optim.Optimizer, *, flavour: str, num_updates: int, loss_scale: float | None
) -> dict[str, Any]:
    """One rank's checkpoint dict, as fairseq (``flavour="fairseq"``) or metaseq (``"metaseq"``) builds it."""
    optimizer_state = optim.state_dict()
    if loss_scale is not None:
        optimizer_state["loss_scale"] = loss_scale  # FP16Optimizer.state_dict()
    cfg: dict[str, Any] = {
        "common": {"fp16": loss_scale is not None, "seed": 1},
        "distributed_training": {"use_sharded_state": True, "distributed_world_size": model.world_size},
        "optimization": {"lr": [0.01], "max_update": 100},
    }
    state: dict[str, Any] = {
        "cfg": cfg,
        "model": model.local_state_dict(),
        "criterion": None,
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "FP16Optimizer" if loss_scale is not None else "FairseqAdam",
                "lr_scheduler_state": {"best": None},
                "num_updates": num_updates,
            }
        ],
        "task_state": {},
        "extra_state": {
            "metrics": {"train": {"loss": {"val": np.float64(2.5), "count": num_updates}}},
            "previous_training_time": 1.5,
            "train_iterator": {"epoch": 1, "iterations_in_epoch": num_updates, "shuffle": True, "version": 2},
        },
        "last_optimizer_state": optimizer_state,
    }
    if flavour == "fairseq":
        cfg["model"] = argparse.Namespace(arch="transformer_lm", dropout=0.1)  # legacy models keep a Namespace
        state = {"args": None, **state, "fsdp_metadata": model.local_metadata_dict()}
    else:
        state["extra_state"]["ewm_loss"] = 2.4
        state["shard_metadata"] = model.local_metadata_dict()
    return state


def save_shard(state: dict[str, Any], prefix: Path, rank: int) -> Path:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    path = prefix.parent / f"{prefix.name}-shard{rank}.pt"
    torch.save(state, path)
    return path


def set_prefix(root: Path, name: str, world_size: int) -> Path:
    return root / f"{name}-w{world_size}" / PREFIX


# ---------------------------------------------------------------------------------------------------
# Rank functions


def _fairscale_job(name: str, seed: int = 0) -> tuple[Any, torch.optim.Optimizer]:
    spec = VARIANTS[name]
    root = M.wrap(M.make_net(seed), "deep", flatten=spec["flatten"])
    params = M.fsdp_param_groups(root) if spec["groups"] else root.parameters()
    return root, M.OPTIMIZERS["adam"](params)


def _write_sets(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """Train each variant SAVE_AT steps, gather it (ours) and write its shard set; "groups" also a later save."""
    import fsdp_optim

    gathered = {}
    for name, spec in VARIANTS.items():
        root, optim = _fairscale_job(name)
        for step in range(SAVE_AT):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        full = fsdp_optim.gather_full_optim_state_dict(root, optim)
        args = {"flavour": spec["flavour"], "loss_scale": spec["loss_scale"]}
        save_shard(checkpoint_dict(root, optim, num_updates=SAVE_AT, **args), set_prefix(out, name, world_size), rank)
        if name == "groups":
            M.train_step(root, optim, *M.local_batch(SAVE_AT, rank, world_size))
            later = checkpoint_dict(root, optim, num_updates=SAVE_AT + 1, **args)
            save_shard(later, set_prefix(out, "later", world_size), rank)
        if rank == 0:
            gathered[name] = full
    return gathered


def _resume_fairscale(rank: int, world_size: int, prefixes: dict[str, Path]) -> dict[str, Any]:
    """fairseq's load: ``load_local_state_dict`` + ``optimizer.load_state_dict`` of this rank's file; train on.
    Returns rank 0's final full model state (flat variants only: fairscale's ``state_dict()`` asserts on an
    unflattened parameter that forward never used) and our gather of the final optimizer state."""
    import fsdp_optim

    finals = {}
    for name, prefix in prefixes.items():
        root, optim = _fairscale_job(name, seed=123)  # another init: the load must win
        # fairseq and metaseq load their own files with weights_only=False (cfg may hold a Namespace).
        shard = torch.load(f"{prefix}-shard{rank}.pt", map_location="cpu", weights_only=False)
        # fairscale's load_local_state_dict frees full parameters that nested units make lazily (on first
        # use); state_dict() makes them without a forward pass.
        root.local_state_dict()
        root.load_local_state_dict(shard["model"])
        optim.load_state_dict(shard["last_optimizer_state"])
        for step in range(SAVE_AT, TOTAL):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        model = root.state_dict() if VARIANTS[name]["flatten"] else None
        optim_state = fsdp_optim.gather_full_optim_state_dict(root, optim)
        if rank == 0:
            finals[name] = {"model": model, "optim": optim_state}
    return finals


def _resume_fsdp2(rank: int, world_size: int, dcp_dir: Path) -> dict[str, Any]:
    """The README recipe: FSDP2 (``fully_shard``) loads the DCP export with ``dcp.load`` + ``set_state_dict``."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    net = M.make_net(seed=123)
    for unit in M.NESTINGS["deep"]:
        fully_shard(net.get_submodule(unit), mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = M.OPTIMIZERS["adam"](M.plain_param_groups(net))

    model_sd, optim_sd = get_state_dict(net, optim)
    state = {"model": model_sd, "optimizer": optim_sd}  # to_dcp's keys
    dcp.load(state, checkpoint_id=str(dcp_dir))
    set_state_dict(net, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    for step in range(SAVE_AT, TOTAL):
        M.train_step(net, optim, *M.local_batch(step, rank, world_size))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    final = {
        "model": get_model_state_dict(net, options=full),
        "optim": get_optimizer_state_dict(net, optim, options=full),
    }
    return final if rank == 0 else {}


def _job_w3_write(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    return {"gathered": _write_sets(rank, world_size, out)}


def _job_w2(rank: int, world_size: int, out: Path, resharded: dict[str, Path], dcp_dir: Path) -> dict[str, Any]:
    return {
        "gathered": _write_sets(rank, world_size, out),
        "fairscale": _resume_fairscale(rank, world_size, resharded),
        "fsdp2": _resume_fsdp2(rank, world_size, dcp_dir),
    }


def _job_w3_resume(rank: int, world_size: int, resharded: dict[str, Path], dcp_dir: Path) -> dict[str, Any]:
    return {
        "fairscale": _resume_fairscale(rank, world_size, resharded),
        "fsdp2": _resume_fsdp2(rank, world_size, dcp_dir),
    }


def _job_w1(rank: int, world_size: int, dcp_dir: Path) -> dict[str, Any]:
    return {"fsdp2": _resume_fsdp2(rank, world_size, dcp_dir)}


# ---------------------------------------------------------------------------------------------------
# Orchestration: once per pytest process


@dataclass(frozen=True)
class Jobs:
    root: Path
    gathered: dict[int, dict[str, Any]]  # world size -> variant -> our gathered full dict at SAVE_AT
    fairscale: dict[tuple[int, int], dict[str, Any]]  # (from, to) -> variant -> {"model", "optim"} at TOTAL
    fsdp2: dict[int, dict[str, Any]]  # world size -> {"model", "optim"} final full state dicts
    dcp_dirs: dict[int, Path]  # source world size -> DCP export of its "groups" set

    def prefix(self, name: str, world_size: int) -> Path:
        return set_prefix(self.root, name, world_size)


_CACHE: dict[str, Jobs] = {}


def run_jobs(root: Path) -> Jobs:
    """Write sets at world sizes 3 and 2, reshard 3 -> 2 and 2 -> 3 offline, export to DCP, and resume:
    fairscale at 2 and 3 from the resharded sets, FSDP2 at 1, 2 and 3 from the exports."""
    if "jobs" in _CACHE:
        return _CACHE["jobs"]
    from fsdp_optim import to_dcp
    from fsdp_optim.fairseq import reshard_shards

    gathered, fairscale, fsdp2, dcp_dirs = {}, {}, {}, {}
    gathered[3] = run_ranks(_job_w3_write, 3, root)[0]["gathered"]
    to2 = {name: root / f"{name}-3to2" / PREFIX for name in VARIANTS}
    for name, prefix in to2.items():
        reshard_shards(set_prefix(root, name, 3), 2, prefix.parent)
    dcp_dirs[3] = root / "dcp-from-w3"
    to_dcp(set_prefix(root, "groups", 3), dcp_dirs[3])
    w2 = run_ranks(_job_w2, 2, root, to2, dcp_dirs[3])[0]
    gathered[2], fairscale[(3, 2)], fsdp2[2] = w2["gathered"], w2["fairscale"], w2["fsdp2"]
    to3 = {name: root / f"{name}-2to3" / PREFIX for name in VARIANTS}
    for name, prefix in to3.items():
        reshard_shards(set_prefix(root, name, 2), 3, prefix.parent)
    dcp_dirs[2] = root / "dcp-from-w2"
    to_dcp(set_prefix(root, "groups", 2), dcp_dirs[2])
    w3 = run_ranks(_job_w3_resume, 3, to3, dcp_dirs[2])[0]
    fairscale[(2, 3)], fsdp2[3] = w3["fairscale"], w3["fsdp2"]
    fsdp2[1] = run_ranks(_job_w1, 1, dcp_dirs[3])[0]["fsdp2"]
    _CACHE["jobs"] = Jobs(root, gathered, fairscale, fsdp2, dcp_dirs)
    return _CACHE["jobs"]


def reference(name: str, steps: int = TOTAL) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Uninterrupted unwrapped training of a variant for ``steps`` steps."""
    net = M.make_net()
    params = M.plain_param_groups(net) if VARIANTS[name]["groups"] else net.parameters()
    return M.train_plain("adam", range(steps), net, M.OPTIMIZERS["adam"](params))
