"""gather_full_optim_state_dict and get_shard_from_optim_state_dict on real gloo groups and real FSDP.

Every optimizer runs inside one spawn per (world size, flatten) case, to keep the suite fast.
"""

from __future__ import annotations

import io

import _models as M
import torch
from _checks import assert_full_matches_plain, assert_identical, assert_unchanged, snapshot
from _dist import run_ranks
from parameterized import parameterized


def _skip_unused_if_flat(flatten: bool):
    # In a flat parameter, FSDP hands a parameter that forward never used a zero gradient, so it gets
    # optimizer state (and weight decay) that the unwrapped model's optimizer does not give it.
    return (lambda name: name.startswith("unused.")) if flatten else (lambda name: False)


def _train_and_gather(rank: int, world_size: int, flatten: bool, optimizers: list[str]) -> None:
    skip = _skip_unused_if_flat(flatten)
    for name in optimizers:
        root = M.wrap(M.make_net(), "deep", flatten=flatten)
        optim = M.OPTIMIZERS[name](M.fsdp_param_groups(root))
        for step in range(3):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        before = snapshot(optim.state_dict())

        recipient = world_size - 1  # not always rank 0
        full = root.gather_full_optim_state_dict(optim, recipient_rank=recipient)
        everywhere = root.gather_full_optim_state_dict(optim, recipient_rank=None)
        by_object = root.gather_full_optim_state_dict(optim, recipient_rank=recipient, transport="object")
        assert_unchanged(before, optim)

        # Every rank cuts its own shard back out of the full dict: exactly what it holds.
        local = optim.state_dict()
        assert_identical(root.get_shard_from_optim_state_dict(everywhere, optim=optim), local, f"{name} shard")
        assert_identical(root.get_shard_from_optim_state_dict(everywhere), local, f"{name} shard (no optim)")

        if rank != recipient:
            assert full is None and by_object is None
            continue
        assert_identical(full, everywhere, f"{name}: recipient vs all ranks")
        assert_identical(full, by_object, f"{name}: tensor vs object transport")
        _, plain = M.train_plain(name, range(3))
        assert_full_matches_plain(full, plain.state_dict(), skip=skip)
        assert full["fsdp_optim"]["optimizer"] == type(optim).__name__
        assert full["fsdp_optim"]["world_size"] == world_size

        # The dict survives torch.save / torch.load(weights_only=True) and loads into a plain optimizer.
        buffer = io.BytesIO()
        torch.save(full, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert_identical(loaded, full, f"{name}: after save/load")
        fresh = M.OPTIMIZERS[name](M.plain_param_groups(M.make_net()))
        fresh.load_state_dict(loaded)
        assert_full_matches_plain(full, fresh.state_dict(), skip=skip, rel=0)


CASES = [(1, True), (1, False), (2, True), (2, False), (3, True), (3, False), (4, True)]


@parameterized.expand(CASES, name_func=lambda f, n, p: f"{f.__name__}_ws{p.args[0]}_{'flat' if p.args[1] else 'unflat'}")
def test_gather_matches_unwrapped_optimizer_and_round_trips(world_size: int, flatten: bool) -> None:
    """After identical training, the gathered dict equals the unwrapped optimizer's state_dict(), for all
    eight optimizers, both transports and any recipient; get_shard(gather(x)) is exactly the local shard."""
    run_ranks(_train_and_gather, world_size, flatten, list(M.OPTIMIZERS))


def _before_any_forward(rank: int, world_size: int) -> None:
    root = M.wrap(M.make_net(), "deep")
    optim = torch.optim.Adagrad(M.fsdp_param_groups(root), lr=0.1)  # Adagrad has state before any step
    full = root.gather_full_optim_state_dict(optim, recipient_rank=None)
    plain = torch.optim.Adagrad(M.plain_param_groups(M.make_net()), lr=0.1)
    assert_full_matches_plain(full, plain.state_dict())
    assert_identical(root.get_shard_from_optim_state_dict(full, optim=optim), optim.state_dict(), "shard")


def _mixed_precision(rank: int, world_size: int) -> None:
    root = M.wrap(M.make_net(), "deep", mixed_precision=True)
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(3):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    full = root.gather_full_optim_state_dict(optim, recipient_rank=None)
    assert all(v.dtype == torch.float32 for s in full["state"].values() for k, v in s.items() if k != "step")
    assert_identical(root.get_shard_from_optim_state_dict(full, optim=optim), optim.state_dict(), "shard")
    _, plain = M.train_plain("adam", range(3))
    # fp16 compute against an fp32 reference: close to 1% of each tensor's scale, not bit-equal.
    assert_full_matches_plain(full, plain.state_dict(), skip=_skip_unused_if_flat(True), rel=1e-2)


def test_gather_before_any_forward() -> None:
    run_ranks(_before_any_forward, 2)


def test_mixed_precision_keeps_fp32_master_state() -> None:
    run_ranks(_mixed_precision, 2)


def _host_basics(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    state = root.state_dict()
    root.load_state_dict(state)
    with root.summon_full_params():
        summoned = {name: p.detach().clone() for name, p in root.named_parameters()}
    assert set(summoned) >= {"embed.weight", "block2.inner.a.weight"}, sorted(summoned)
    return {k: v.clone() for k, v in state.items()}


def test_fsdp_runs_on_cpu_and_matches_unwrapped_training() -> None:
    """Forward, backward, step, state_dict, load_state_dict and summon_full_params work on CPU/gloo."""
    states = run_ranks(_host_basics, 2)
    net, _ = M.train_plain("adam", range(2))
    plain = net.state_dict()
    for name, value in states[0].items():
        if not name.startswith("unused."):
            torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert_identical(states[0], states[1], "ranks")
