"""Run fairseq's own command-line tools on CPU-only machines, FSDP included::

    torchrun --nproc_per_node 2 -m fsdp_optim.fairseq_launch train DATA --cpu --ddp-backend fully_sharded \\
        --use-sharded-state --distributed-backend gloo ...      # any fairseq-train arguments
    python -m fsdp_optim.fairseq_launch validate DATA --path checkpoint.pt --cpu ...

``train`` and ``validate`` are ``fairseq_cli.train.cli_main`` and ``fairseq_cli.validate.cli_main``, run
unchanged after three things this module does first, and only on a machine without CUDA:

1. :func:`fsdp_optim.enable_host_execution`, so fairseq's ``--ddp-backend fully_sharded`` (fairscale's FSDP)
   runs on the CPU with gloo;
2. the one fairseq patch a CPU-only machine needs: ``Trainer.clip_grad_norm`` moves the local gradient norm
   to the GPU (``total_norm.cuda()``, fairseq 0.12 trainer.py) before all-reducing it whenever FSDP is used;
   here it runs with ``Tensor.cuda()`` returning the tensor itself (the switch's own no-transfer mode);
3. under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set), it passes
   ``--distributed-init-method env:// --distributed-rank R --distributed-world-size W --distributed-no-spawn``:
   fairseq's own torchrun detection computes ``rank % torch.cuda.device_count()``, which divides by zero
   without GPUs, and its spawn path starts ``torch.cuda.device_count()`` (zero) processes.

On a GPU machine nothing is switched or patched: fairseq runs as it ships.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

__all__ = ["distributed_args", "main", "patch_fairseq"]

TOOLS = {"train": "fairseq_cli.train", "validate": "fairseq_cli.validate"}


def patch_fairseq() -> None:
    """Switch fairscale to host execution and make fairseq's ``Trainer.clip_grad_norm`` run without CUDA.

    For the rest of the process; idempotent; does nothing when CUDA is available.
    """
    if torch.cuda.is_available():
        return
    from fairseq.trainer import Trainer

    from fsdp_optim.job.host import enable_for_process, without_transfers

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


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in TOOLS:
        raise SystemExit(
            f"usage: python -m fsdp_optim.fairseq_launch {{{','.join(TOOLS)}}} FAIRSEQ_ARGS...; "
            f"found {args[:1] or 'no tool'}"
        )
    import importlib

    tool = importlib.import_module(TOOLS[args[0]])
    patch_fairseq()
    rest = distributed_args(args[1:], os.environ) if args[0] == "train" else args[1:]
    sys.argv = [f"fairseq-{args[0]}", *rest]
    tool.cli_main()
    # fairseq leaves its process group up; tearing it down before exit keeps a rank from aborting as the
    # interpreter exits (seen once under load: SIGABRT after "done training").
    from fsdp_optim.job.transport import shut_down

    shut_down()


if __name__ == "__main__":
    main()
