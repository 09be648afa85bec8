"""Lose a node mid-training and resume one node smaller from the survivors' memory (issue 26), on one machine.

    python examples/memory_tier_recovery.py            # ~1 min on 2 cores

Phase 1: 4 "nodes" x 2 ranks (processes; each node a directory under /dev/shm) train a small FSDP model, saving to
the memory tier every step and to disk every 5; at step 7 the ranks of node 3 SIGKILL themselves, the others fail
on their next collective. Node 3's memory is removed (the machine is gone). Phase 2: 3 nodes x 2 ranks restore the
newest step the surviving nodes hold whole (step 7: node 3's files come from their replicas on node 0) and train on.
Under torchrun on real nodes the same code needs no ``node=``: a rank's node is ``rank // LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fsdp_optim

RANKS_PER_NODE, KILL_AT, STEPS = 2, 7, 10


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    net[0] = fsdp_optim.FullyShardedDataParallel(net[0])
    model = fsdp_optim.FullyShardedDataParallel(net)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _rank(rank: int, world_size: int, port: int, work: str, kill: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=20))
    node = rank // RANKS_PER_NODE
    manager = fsdp_optim.CheckpointManager(
        Path(work) / "durable", every=5, keep=2, memory_every=1, replicas=1, memory_dir=Path(work) / "memory", node=node
    )
    model, optim = _model()
    extra = manager.restore(model, optim)
    start = extra["step"] if extra is not None else 0
    if rank == 0:
        found = "nothing to restore, training from step 0" if extra is None else (
            f"restored step {start} from the {manager.restored_from} tier")
        print(f"W={world_size}: {found}", flush=True)
    for step in range(start + 1, STEPS + 1):
        torch.manual_seed(step * 100 + rank)
        model(torch.randn(8, 16)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        manager.save(step, model, optim, extra={"step": step})
        if kill and step == KILL_AT:
            manager.wait()
            if node == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # the node dies
    manager.wait()
    if rank == 0:
        print(f"W={world_size}: trained to step {STEPS}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="fsdp_optim-example-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        try:
            mp.start_processes(_rank, args=(8, _port(), str(work), True), nprocs=8, start_method="spawn")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            print(f"phase 1 ended: {exc}".splitlines()[0], flush=True)
        shutil.rmtree(work / "memory" / "node-3")  # node 3's memory went with it
        mp.start_processes(_rank, args=(6, _port(), str(work), False), nprocs=6, start_method="spawn")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
