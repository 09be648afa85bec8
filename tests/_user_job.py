"""A user's training job, one rank per process, started the way torchrun starts one (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment): ``python tests/_user_job.py SCENARIO DIRECTORY``.

Scenarios (what a user did, each then printing ``rank R: ...`` lines on stdout):
- ``lost``: an async save, then ``dist.destroy_process_group()`` before ``handle.wait()``, then a normal exit.
- ``interrupted``: saves into DIRECTORY until a SIGINT to the process group (Ctrl-C) interrupts one (SIGINT is
  ignored between saves); prints the outcome (``outcome committed N`` / ``outcome interrupted N``), then saves once
  more with ``overwrite=True`` (``after ok``).
- ``rank0-only``: rank 0 calls ``save_checkpoint`` alone; the other rank waits at a barrier, then exits.

Started with SIGINT at its default (a background job of a script would inherit it ignored).
"""

from __future__ import annotations

import datetime
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _models as M  # noqa: E402

import fsdp_optim  # noqa: E402

TIMEOUT_S = 120


def _say(rank: int, text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


def _lost(rank: int, world_size: int, directory: str) -> None:
    model, optim = _trained(rank, world_size)
    fsdp_optim.async_save_checkpoint(model, optim, directory, extra={"step": 1})
    dist.destroy_process_group()  # the user's mistake: before handle.wait()
    _say(rank, "returned")


def _interrupted(rank: int, world_size: int, directory: str) -> None:
    model, optim = _trained(rank, world_size)
    step = 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches this loop inside a save only (the ranks' code
    while True:  # outside it is the job's own: a rank interrupted there leaves the others in a save's collective)
        step += 1
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            fsdp_optim.save_checkpoint(model, optim, directory, extra={"step": step}, overwrite=True)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            break
        _say(rank, f"saved {step}")
    committed = fsdp_optim.load_checkpoint(model, optim, directory)["step"]
    _say(rank, f"outcome {'committed' if committed == step else 'interrupted'} {step} (on disk: {committed})")
    fsdp_optim.save_checkpoint(model, optim, directory, extra={"step": -1}, overwrite=True)
    _say(rank, "after ok")


def _rank0_only(rank: int, world_size: int, directory: str) -> None:
    model, optim = _trained(rank, world_size)
    if rank == 0:
        try:
            fsdp_optim.save_checkpoint(model, optim, directory)
        except Exception as e:
            _say(rank, f"refused {type(e).__name__}: {e}")
            raise
    else:
        _say(rank, "not saving")


def _trained(rank: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = M.wrap(M.make_net(0), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(model))
    M.train_step(model, optim, *M.local_batch(0, rank, world_size))
    return model, optim


SCENARIOS = {"lost": _lost, "interrupted": _interrupted, "rank0-only": _rank0_only}


def main() -> None:
    scenario, directory = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    SCENARIOS[scenario](rank, world_size, directory)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
