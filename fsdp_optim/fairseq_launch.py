"""Run fairseq's own command-line tools on CPU-only machines, FSDP included::

    torchrun --nproc_per_node 2 -m fsdp_optim.fairseq_launch train DATA --cpu --ddp-backend fully_sharded \\
        --use-sharded-state --distributed-backend gloo ...      # any fairseq-train arguments
    python -m fsdp_optim.fairseq_launch validate DATA --path checkpoint.pt --cpu ...

``fairseq_cli.train.cli_main`` / ``fairseq_cli.validate.cli_main``, unchanged, after three things done only on a
machine without CUDA: the host switch (:func:`patch_fairseq`), the one fairseq patch a CPU-only machine needs
(``Trainer.clip_grad_norm``'s ``total_norm.cuda()``), and under ``torchrun`` fairseq's distributed options from the
environment (:func:`distributed_args`: its own detection divides by ``torch.cuda.device_count()``).
``train ... --fsdp-optim-checkpoints DIR`` also writes our whole checkpoint ``DIR/step-NNNNNNNN`` at each of
fairseq's saves (:func:`save_whole_checkpoints`). docs/migrating.md ("Train and resume on CPU") shows a session and
what ``extra`` holds.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["checkpoints_arg", "distributed_args", "main", "patch_fairseq", "plain_json", "save_whole_checkpoints"]

TOOLS = {"train": "fairseq_cli.train", "validate": "fairseq_cli.validate"}
CHECKPOINTS_FLAG = "--fsdp-optim-checkpoints"


def patch_fairseq() -> None:
    """Switch fairscale to host execution and make fairseq's ``Trainer.clip_grad_norm`` run without CUDA (with
    ``Tensor.cuda()`` returning the tensor itself), for the rest of the process; idempotent."""
    from fairseq.trainer import Trainer

    from fsdp_optim.job.host import enable_for_process
    from fsdp_optim.job.host_fixes import without_transfers

    enable_for_process()
    if not getattr(Trainer.clip_grad_norm, "_fsdp_optim_host", False):
        patched = without_transfers(Trainer.clip_grad_norm)
        patched._fsdp_optim_host = True  # type: ignore[attr-defined]
        Trainer.clip_grad_norm = patched  # type: ignore[method-assign]


def distributed_args(argv: Sequence[str], environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """``argv`` plus fairseq's distributed options from torchrun's environment, unless they are given."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in environ for k in needed) or "--distributed-init-method" in argv:
        return list(argv)
    return [
        *argv,
        "--distributed-init-method",
        "env://",
        "--distributed-rank",
        environ["RANK"],
        "--distributed-world-size",
        environ["WORLD_SIZE"],
        "--distributed-no-spawn",
    ]


def checkpoints_arg(argv: Sequence[str]) -> tuple[list[str], Path | None]:
    """``argv`` without ``--fsdp-optim-checkpoints DIR`` (or ``=DIR``), and ``DIR`` (None when not given)."""
    rest: list[str] = []
    found: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == CHECKPOINTS_FLAG:
            value = next(args, None)
            if value is None or value.startswith("--"):
                raise SystemExit(f"{CHECKPOINTS_FLAG}: expected a directory, found {value or 'nothing'}")
            found.append(value)
        elif arg.startswith(CHECKPOINTS_FLAG + "="):
            found.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    if len(found) > 1:
        raise SystemExit(f"{CHECKPOINTS_FLAG}: expected once, found {len(found)} times ({found})")
    return rest, Path(found[0]) if found else None


def plain_json(value: Any) -> Any:
    """``value`` (a tree of dicts, lists, tuples, scalars) with only what JSON holds: dict keys as ``str``,
    tuples as lists, numpy scalars as Python numbers, non-finite floats and anything else as its ``str``."""
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    item = getattr(value, "item", None)  # numpy and 0-d torch scalars
    if callable(item) and getattr(value, "ndim", None) == 0:
        return plain_json(item())
    return str(value)


def save_whole_checkpoints(directory: str | os.PathLike[str]) -> None:
    """Make each of fairseq's checkpoint saves also write ``directory/step-NNNNNNNN`` with
    :func:`fsdp_optim.save_checkpoint` on every rank (module docstring). For the rest of the process; a second
    call replaces the directory."""
    from fairseq import checkpoint_utils

    fairseq_save = getattr(checkpoint_utils.save_checkpoint, "_fsdp_optim_wrapped", checkpoint_utils.save_checkpoint)

    def saving(cfg: Any, trainer: Any, epoch_itr: Any, val_loss: Any) -> Any:
        saved = fairseq_save(cfg, trainer, epoch_itr, val_loss)
        if not cfg.no_save:
            _save_whole(Path(directory), trainer, epoch_itr, val_loss)
        return saved

    # fairseq keeps its best loss as an attribute of the function its module names `save_checkpoint`
    saving._fsdp_optim_wrapped = fairseq_save  # type: ignore[attr-defined]
    checkpoint_utils.save_checkpoint = saving


def _save_whole(directory: Path, trainer: Any, epoch_itr: Any, val_loss: Any) -> Any:
    """Every rank: fairseq's model and optimizer, and what its loop needs back, as one whole checkpoint."""
    from omegaconf import OmegaConf

    from fsdp_optim.core.steps import step_dir_name
    from fsdp_optim.job.whole_save import save_checkpoint

    optim = trainer.optimizer.optimizer  # FairseqOptimizer (FP16Optimizer too) -> the torch optimizer it steps
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"trainer.optimizer.optimizer: expected a torch.optim.Optimizer, found {type(optim).__name__}")
    scheduler = getattr(trainer, "lr_scheduler", None)
    extra = {
        "num_updates": trainer.get_num_updates(),
        "epoch": epoch_itr.epoch,
        "val_loss": plain_json(val_loss),
        "optimizer": type(trainer.optimizer).__name__,
        "train_iterator": plain_json(epoch_itr.state_dict()),
        "lr_scheduler": plain_json(scheduler.state_dict()) if scheduler is not None else None,
        "cfg": plain_json(OmegaConf.to_container(trainer.cfg, resolve=True)),
    }
    return save_checkpoint(trainer.model, optim, directory / step_dir_name(extra["num_updates"]), extra=extra)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in TOOLS:
        raise SystemExit(
            f"usage: python -m fsdp_optim.fairseq_launch {{{','.join(TOOLS)}}} FAIRSEQ_ARGS...; "
            f"found {args[:1] or 'no tool'}"
        )
    import importlib

    tool = importlib.import_module(TOOLS[args[0]])
    # fairseq computes where --cpu says (a machine without CUDA has no other choice), not where CUDA exists.
    if "--cpu" in args or not torch.cuda.is_available():
        patch_fairseq()
    rest, whole = checkpoints_arg(args[1:]) if args[0] == "train" else (args[1:], None)
    if whole is not None:
        save_whole_checkpoints(whole)
    rest = distributed_args(rest, os.environ) if args[0] == "train" else rest
    sys.argv = [f"fairseq-{args[0]}", *rest]
    tool.cli_main()
    # fairseq leaves its process group up; tearing it down before exit keeps a rank from aborting as the
    # interpreter exits (seen once under load: SIGABRT after "done training").
    from fsdp_optim.job.transport import shut_down

    shut_down()


if __name__ == "__main__":
    main()
