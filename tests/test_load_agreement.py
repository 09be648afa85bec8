"""``load_sharded_optim_state`` of a directory is all or nothing on every rank.

A world-size-2 job (gloo, our class, Adam over two param groups) saves a sharded checkpoint, trains one more
step (so a load would show), then rank 0 flips one byte of rank 1's file. Every rank then loads the checkpoint
at the saved world size, where each rank reads only its own file: before, rank 1 raised and rank 0 loaded and
carried on (to die later in gloo). Now both ranks raise the same checksum error, naming rank 1's file, and
neither optimizer changed; the group still works afterwards.
"""

from __future__ import annotations

from pathlib import Path

import _models as M
import torch.distributed as dist
from _checks import assert_identical, snapshot
from _dist import run_ranks
from _forge import manifest_rank_file

import fsdp_optim


def _flip_a_data_byte(path: Path) -> None:
    """One byte in the middle of a safetensors rank file's tensor data: only a checksum can tell."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start + (len(raw) - start) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _load_damaged(rank: int, world_size: int, out: str) -> tuple[str, str, str]:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    ckpt = Path(out) / "ckpt"
    fsdp_optim.save_sharded_optim_state(root, optim, ckpt)
    M.train_step(root, optim, *M.local_batch(2, rank, world_size))  # the live state now differs from the saved
    victim = manifest_rank_file(ckpt, 1)
    if rank == 0:
        _flip_a_data_byte(victim)
    dist.barrier()
    before = snapshot(optim.state_dict())
    kind, raised = "", "nothing raised"
    try:
        fsdp_optim.load_sharded_optim_state(root, optim, ckpt)
    except ValueError as exc:
        kind, raised = type(exc).__name__, str(exc)
    assert_identical(optim.state_dict(), before, f"rank {rank}: the optimizer after a refused load")
    dist.barrier()  # the ranks are still in step
    return victim.name, kind, raised


def test_a_damaged_rank_file_raises_the_same_error_on_every_rank_and_changes_no_optimizer(tmp_path) -> None:
    outcomes = run_ranks(_load_damaged, 2, str(tmp_path))
    victim = outcomes[0][0]
    (_, kind0, message0), (_, kind1, message1) = outcomes
    assert kind0 == kind1 == "ValueError", outcomes
    assert victim in message1 and "checksum" in message1, message1  # the reading rank's own error
    assert message0.startswith(message1) and "[raised on rank 1;" in message0, (message0, message1)
