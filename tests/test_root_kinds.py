"""Every kind of fairscale FSDP root: the module functions work on each, without re-wrapping.

Four roots of the same model (``_models.Net``), each trained a few real Adam steps at world size 2 on gloo:

- ``fairscale``: fairscale's own ``FullyShardedDataParallel``, nested by hand, inside ``fsdp_optim.host_execution()``;
- ``fairseq_style``: a subclass defined the way fairseq defines its own (extra constructor arguments, a full
  ``state_dict`` on rank 0 only and a ``load_state_dict`` that broadcasts it), wrapped with fairscale's
  ``enable_wrap`` / ``wrap`` as fairseq's ``fsdp_enable_wrap`` / ``fsdp_wrap`` do;
- ``auto_wrap``: fairscale's class through ``enable_wrap`` + ``auto_wrap`` with a size policy, as
  Lightning's fairscale strategy leaves a model;
- ``ours``: ``fsdp_optim.FullyShardedDataParallel`` (last in each process: it switches host execution on
  for the rest of the process).

The same checks run for each, through the module functions only:

1. ``gather_full_optim_state_dict`` -> ``get_shard_from_optim_state_dict`` -> ``load_state_dict`` gives
   back the live state exactly, and the gathered dict is the unwrapped optimizer's state;
2. ``save_sharded_optim_state`` -> ``load_sharded_optim_state`` into a fresh optimizer gives it exactly;
3. resume at world size 3 (re-cut from the world-size-2 checkpoint, and from an offline ``reshard`` to 3,
   which agree exactly), and training goes on to match uninterrupted unwrapped training;
4. a fairscale-native dict (fairscale's own ``gather_full_optim_state_dict``, SGD with momentum: its CPU
   gather is wrong for Adam, see ANCHORS.md) loads through get_shard, load and scatter exactly, also at
   world size 3; offline, the CLI says it needs ``--layout`` and reshards it with one;
5. the README's path for a model someone else wrapped (fairseq-style, auto_wrap): the full dict saved with
   the module functions resumes at world size 3 through ``get_shard_from_optim_state_dict``.

Two spawns in all (world sizes 2 and 3) run every root; each check records its failure per root instead
of raising in the rank, so every parametrized test reports its own root and nothing desynchronises.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from _checks import assert_full_matches_plain, assert_identical, assert_unchanged, snapshot
from _dist import run_ranks
from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP
from fairscale.nn import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap

import fsdp_optim
from fsdp_optim.cli import main as cli
from fsdp_optim.core.preconditions import is_full_dict
from fsdp_optim.formats.fairscale import is_fairscale_native

ROOTS = ["fairscale", "fairseq_style", "auto_wrap", "ours"]  # ours last: see the module docstring
WRAPPED_BY_OTHERS = ["fairseq_style", "auto_wrap"]
SAVE_AT, TOTAL = 3, 6
RESUME_WORLD_SIZE = 3
REL = 1e-4  # six steps of different reduction order in fp32


def _skip_unused(name: str) -> bool:
    # A flat parameter gives a parameter that forward never uses a zero gradient, hence state.
    return name.startswith("unused.")


# ---------------------------------------------------------------------------------------------------
# The roots


class FairseqStyleFSDP(FairscaleFSDP):
    """A subclass shaped like fairseq's ``FullyShardedDataParallel`` (fairseq/distributed/
    fully_sharded_data_parallel.py): keyword-only extra constructor arguments, ``state_dict`` that returns
    the full weights on rank 0 and ``{}`` elsewhere (``local_state_dict`` with ``use_sharded_state``), and
    ``load_state_dict`` that broadcasts rank 0's dict first. Both overrides call super."""

    def __init__(self, *args: Any, is_moe: bool | None = None, use_sharded_state: bool = False, **kwargs: Any):
        assert is_moe is not None, "fairseq passes is_moe explicitly"
        super().__init__(*args, **kwargs)
        self.is_moe = is_moe
        self.use_sharded_state = use_sharded_state

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if self.use_sharded_state:
            return super().local_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.rank == 0:
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        super().state_dict()  # a collective: every rank takes part, only rank 0 keeps the result
        return destination or {}

    def load_state_dict(self, state_dict: Any, strict: bool = True, model_cfg: Any = None) -> Any:  # noqa: ARG002
        if self.use_sharded_state:
            return super().load_local_state_dict(state_dict, strict=strict)
        box = [state_dict]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return super().load_state_dict(box[0], strict=strict)


def _nest(net: M.Net, make: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """``make`` each unit of ``_models.NESTINGS["deep"]`` (innermost first), then the root."""
    for path in M.NESTINGS["deep"]:
        parent_path, _, name = path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        setattr(parent, name, make(getattr(parent, name)))
    return make(net)


def _size_or_frozen_policy(module: torch.nn.Module, recurse: bool, unwrapped_params: int, **kwargs: Any) -> bool:
    """fairscale's size policy (units of 80 parameters or more: block1, block2, then the root's rest), plus
    a module whose parameters are all frozen as a unit of its own: fairscale flattens only parameters that
    agree on ``requires_grad``."""
    params = list(module.parameters())
    if params and not any(p.requires_grad for p in params):
        return True  # recurse into it (fairscale decides to wrap only where it recursed), then wrap it
    return default_auto_wrap_policy(module, recurse, unwrapped_params, min_num_params=80, **kwargs)


def _build(kind: str, net: M.Net) -> torch.nn.Module:
    if kind == "fairscale":
        root = _nest(net, FairscaleFSDP)
    elif kind == "fairseq_style":
        with enable_wrap(wrapper_cls=FairseqStyleFSDP, is_moe=False, use_sharded_state=False):
            root = _nest(net, wrap)
        assert type(root) is FairseqStyleFSDP
    elif kind == "auto_wrap":
        with enable_wrap(wrapper_cls=FairscaleFSDP):
            root = auto_wrap(net, auto_wrap_policy=_size_or_frozen_policy)  # the root's rest is large: wrapped too
        units = sorted(path for path, m in root.named_modules() if isinstance(m, FairscaleFSDP))
        assert type(root) is FairscaleFSDP and len(units) == 4, units  # root, block1, block2, frozen
    else:
        root = M.wrap(net, "deep")
        assert type(root) is fsdp_optim.FullyShardedDataParallel
    return root


@contextlib.contextmanager
def _switch(kind: str) -> Iterator[None]:
    """fairscale's own classes run on the CPU host inside the reversible switch; ours needs none."""
    with contextlib.nullcontext() if kind == "ours" else fsdp_optim.host_execution():
        yield


def _adam(root: torch.nn.Module) -> torch.optim.Optimizer:
    return M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))  # two param groups (block2 apart)


def _sgd(root: torch.nn.Module) -> torch.optim.Optimizer:
    return M.OPTIMIZERS["sgd_momentum"](root.parameters())  # fairscale's own gather needs one group


class _Checks:
    """Runs named checks inside a rank; a failing check is recorded (with its traceback), not raised."""

    def __init__(self) -> None:
        self.failures: dict[str, str] = {}

    def __call__(self, name: str, check: Callable[[], None]) -> None:
        try:
            check()
        except AssertionError:
            self.failures[name] = traceback.format_exc()


# ---------------------------------------------------------------------------------------------------
# World size 2: train, check round trips, save


def _at_two(rank: int, world_size: int, out: str) -> dict[str, dict]:
    results = {}
    for kind in ROOTS:
        directory = os.path.join(out, kind)
        os.makedirs(directory, exist_ok=True)
        with _switch(kind):
            results[kind] = _train_check_save(kind, rank, world_size, directory)
    return results


def _train_check_save(kind: str, rank: int, world_size: int, out: str) -> dict:
    checks = _Checks()
    root = _build(kind, M.make_net())
    optim = _adam(root)
    for step in range(SAVE_AT):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    live = snapshot(optim.state_dict())

    # 1. gather -> get_shard -> load
    full = fsdp_optim.gather_full_optim_state_dict(root, optim, recipient_rank=None)
    checks("gather leaves the optimizer alone", lambda: assert_unchanged(live, optim))
    shard = fsdp_optim.get_shard_from_optim_state_dict(root, full, optim=optim)
    fresh = _adam(root)
    fresh.load_state_dict(shard)
    checks("gather -> get_shard -> load", lambda: assert_identical(fresh.state_dict(), live, "loaded"))

    # 2. save -> load into a fresh optimizer
    fsdp_optim.save_sharded_optim_state(root, optim, os.path.join(out, "ckpt"))
    loaded = _adam(root)
    fsdp_optim.load_sharded_optim_state(root, loaded, os.path.join(out, "ckpt"))
    checks("save -> load", lambda: assert_identical(loaded.state_dict(), live, "loaded"))

    # What the resume at world size 3 starts from: the model's full weights and the full dict (README path).
    model_state = root.state_dict()  # the fairseq-style root returns {} on ranks other than 0
    if rank == 0:
        torch.save(model_state, os.path.join(out, "model.pt"))
        torch.save(full, os.path.join(out, "optim_full.pt"))

    _fairscale_native(kind, rank, world_size, out, checks)
    return {"full": full if rank == 0 else None, "failures": checks.failures}


def _assert_native(obj: Any) -> None:
    assert is_fairscale_native(obj) and not is_full_dict(obj), sorted(obj)


def _fairscale_native(kind: str, rank: int, world_size: int, out: str, checks: _Checks) -> None:
    """4. A dict written by fairscale's own gather loads through get_shard, load (a file) and scatter."""
    root = _build(kind, M.make_net())
    optim = _sgd(root)
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    live = snapshot(optim.state_dict())
    ours = fsdp_optim.gather_full_optim_state_dict(root, optim, recipient_rank=None)
    native = FairscaleFSDP.gather_full_optim_state_dict(root, optim)  # recipient: rank 0
    path = os.path.join(out, "native.pt")
    if rank == 0:
        torch.save(native, path)
        torch.save(ours, os.path.join(out, "sgd_full.pt"))
        fsdp_optim.save_layout(root, os.path.join(out, "layout.pt"))
    dist.barrier()
    native = torch.load(path, weights_only=True)
    checks("native dict recognised", lambda: _assert_native(native))

    shard = fsdp_optim.get_shard_from_optim_state_dict(root, native, optim=optim)
    checks(
        "native: get_shard == get_shard of ours",
        lambda: assert_identical(shard, fsdp_optim.get_shard_from_optim_state_dict(root, ours, optim=optim)),
    )
    fresh = _sgd(root)
    fresh.load_state_dict(shard)
    checks("native: get_shard -> load", lambda: assert_identical(fresh.state_dict(), live, "get_shard"))

    from_file = _sgd(root)
    fsdp_optim.load_sharded_optim_state(root, from_file, path)  # a file: rank 0 reads it and scatters
    checks("native: load_sharded_optim_state(file)", lambda: assert_identical(from_file.state_dict(), live, "load"))

    scattered = _sgd(root)
    fsdp_optim.scatter_full_optim_state(root, scattered, native if rank == 0 else None)
    checks("native: scatter_full_optim_state", lambda: assert_identical(scattered.state_dict(), live, "scatter"))
    checks("native: input untouched", lambda: assert_identical(native, torch.load(path, weights_only=True)))


# ---------------------------------------------------------------------------------------------------
# World size 3: resume


def _at_three(rank: int, world_size: int, out: str) -> dict[str, dict]:
    results = {}
    for kind in ROOTS:
        with _switch(kind):
            results[kind] = _resume(kind, rank, world_size, os.path.join(out, kind))
    return results


def _restored(kind: str, rank: int, out: str) -> torch.nn.Module:
    root = _build(kind, M.make_net(seed=123))  # another init: the load must win
    # The fairseq-style root broadcasts rank 0's dict; every other root loads the file on every rank.
    needs_file = rank == 0 or kind != "fairseq_style"
    root.load_state_dict(torch.load(os.path.join(out, "model.pt"), weights_only=True) if needs_file else {})
    return root


def _train_on(root: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, world_size: int) -> tuple:
    for step in range(SAVE_AT, TOTAL):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    model_state = root.state_dict()
    return model_state, fsdp_optim.gather_full_optim_state_dict(root, optim)


def _resume(kind: str, rank: int, world_size: int, out: str) -> dict:
    checks = _Checks()
    result: dict[str, Any] = {}

    # 3. From the world-size-2 checkpoint: re-cut here, and read from its offline reshard to 3.
    root = _restored(kind, rank, out)
    optim = _adam(root)
    fsdp_optim.load_sharded_optim_state(root, optim, os.path.join(out, "ckpt"))
    resharded = _adam(root)
    fsdp_optim.load_sharded_optim_state(root, resharded, os.path.join(out, f"ckpt-ws{world_size}"))
    checks("re-cut == offline reshard", lambda: assert_identical(resharded.state_dict(), optim.state_dict()))
    result["checkpoint"] = _train_on(root, optim, rank, world_size)

    # 5. The README's path for a model someone else wrapped: the full dict through get_shard.
    if kind in WRAPPED_BY_OTHERS:
        root = _restored(kind, rank, out)
        optim = _adam(root)
        full = torch.load(os.path.join(out, "optim_full.pt"), weights_only=True)
        optim.load_state_dict(fsdp_optim.get_shard_from_optim_state_dict(root, full, optim=optim))
        result["full_dict"] = _train_on(root, optim, rank, world_size)

    # 4. The fairscale-native dict cuts at another world size like ours (same wrapping, other world size).
    root = _build(kind, M.make_net())
    sgd = _sgd(root)
    native = torch.load(os.path.join(out, "native.pt"), weights_only=True)
    ours = torch.load(os.path.join(out, "sgd_full.pt"), weights_only=True)
    shard = fsdp_optim.get_shard_from_optim_state_dict(root, native, optim=sgd)
    checks(
        "native at world size 3",
        lambda: assert_identical(shard, fsdp_optim.get_shard_from_optim_state_dict(root, ours, optim=sgd)),
    )
    return {**(result if rank == 0 else {}), "failures": checks.failures}


# ---------------------------------------------------------------------------------------------------
# The jobs, once per module


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict]]:
    out = tmp_path_factory.mktemp("reach")
    at_two = run_ranks(_at_two, 2, str(out))
    for kind in ROOTS:  # offline, no process group: the checkpoint for a world-size-3 job
        fsdp_optim.reshard(out / kind / "ckpt", RESUME_WORLD_SIZE, out / kind / f"ckpt-ws{RESUME_WORLD_SIZE}")
    at_three = run_ranks(_at_three, RESUME_WORLD_SIZE, str(out))
    return out, at_two, at_three


def _failures(results: list[dict], kind: str, *names: str) -> list[str]:
    return [
        f"rank {rank}, {name}:\n{per_rank[kind]['failures'][name]}"
        for rank, per_rank in enumerate(results)
        for name in names
        if name in per_rank[kind]["failures"]
    ]


@functools.cache
def _plain(steps: int) -> tuple[dict, dict]:
    net, plain = M.train_plain("adam", range(steps))
    return net.state_dict(), plain.state_dict()


def _assert_matches_uninterrupted(model_state: dict, final: dict, where: str) -> None:
    net_state, plain_state = _plain(TOTAL)
    for key, value in net_state.items():
        if not _skip_unused(key):
            atol = REL * float(value.abs().max())
            torch.testing.assert_close(model_state[key], value, rtol=REL, atol=atol, msg=lambda m: f"{where} {key}: {m}")
    assert_full_matches_plain(final, plain_state, skip=_skip_unused, rel=REL)


@pytest.mark.parametrize("kind", ROOTS)
def test_gather_get_shard_load_round_trip(jobs, kind: str) -> None:
    _, at_two, _ = jobs
    assert not _failures(at_two, kind, "gather leaves the optimizer alone", "gather -> get_shard -> load")
    # The gathered dict is what a plain Adam over the unwrapped model holds after the same steps.
    assert_full_matches_plain(at_two[0][kind]["full"], _plain(SAVE_AT)[1], skip=_skip_unused, rel=REL)


@pytest.mark.parametrize("kind", ROOTS)
def test_save_then_load_into_a_fresh_optimizer(jobs, kind: str) -> None:
    _, at_two, _ = jobs
    failures = _failures(at_two, kind, "save -> load")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kind", ROOTS)
def test_resume_at_another_world_size_matches_uninterrupted_training(jobs, kind: str) -> None:
    out, _, at_three = jobs
    failures = _failures(at_three, kind, "re-cut == offline reshard")
    assert not failures, "\n".join(failures)
    _assert_matches_uninterrupted(*at_three[0][kind]["checkpoint"], where=f"{kind} (checkpoint at 2, resumed at 3)")
    # The offline reshard consolidates to the saved dict (its header's world size aside).
    full = fsdp_optim.consolidate(out / kind / "ckpt")
    again = fsdp_optim.consolidate(out / kind / f"ckpt-ws{RESUME_WORLD_SIZE}")
    assert_identical(again, {**full, "fsdp_optim": {**full["fsdp_optim"], "world_size": RESUME_WORLD_SIZE}})


@pytest.mark.parametrize("kind", WRAPPED_BY_OTHERS)
def test_model_wrapped_by_someone_else_resumes_from_the_module_functions(jobs, kind: str) -> None:
    """README, "Use with a model someone else wrapped": gather_full_optim_state_dict(model, optim) at
    world size 2, torch.save; at world size 3, get_shard_from_optim_state_dict(model, full, optim=optim)."""
    _, _, at_three = jobs
    _assert_matches_uninterrupted(*at_three[0][kind]["full_dict"], where=f"{kind} (full dict at 2, resumed at 3)")


@pytest.mark.parametrize("kind", ROOTS)
def test_fairscale_native_dict_loads_through_get_shard_load_and_scatter(jobs, kind: str) -> None:
    _, at_two, at_three = jobs
    names = [name for name in at_two[0][kind]["failures"] if name.startswith("native")]
    assert not names, "\n".join(_failures(at_two, kind, *names))
    failures = _failures(at_two, kind, "native dict recognised") + _failures(at_three, kind, "native at world size 3")
    assert not failures, "\n".join(failures)


def _cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    code = cli([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("kind", ROOTS)
def test_cli_says_a_native_dict_needs_layout_and_reshards_it_with_one(jobs, kind: str, capsys, tmp_path) -> None:
    out = jobs[0] / kind
    native, layout, ours = out / "native.pt", out / "layout.pt", out / "sgd_full.pt"
    code, text, err = _cli(capsys, "inspect", native)
    assert code == 0 and err == "", err
    assert "format: fairscale-native full dict" in text and "needs: --layout PATH" in text, text

    for argv in (
        ("consolidate", native, "-o", tmp_path / "c.pt"),
        ("reshard", native, "--world-size", 3, "-o", tmp_path / "r"),
        ("convert", native, "-o", tmp_path / "v.pt"),
    ):
        code, text, err = _cli(capsys, *argv)
        assert code == 1 and text == "" and err.count("\n") == 1, (argv, text, err)
        assert err.startswith("fsdp-optim: error: --layout: ") and "needs --layout PATH" in err, (argv, err)
    assert not (tmp_path / "r").exists() and not (tmp_path / "c.pt").exists()

    full = torch.load(ours, weights_only=True)
    code, text, err = _cli(capsys, "reshard", native, "--world-size", 3, "--layout", layout, "--optimizer", "SGD",
                           "-o", tmp_path / "r")
    assert code == 0 and "3 rank files" in text, err
    assert_identical(fsdp_optim.consolidate(tmp_path / "r"), {**full, "fsdp_optim": {**full["fsdp_optim"], "world_size": 3}})
    code, _, err = _cli(capsys, "consolidate", native, "--layout", layout, "--optimizer", "SGD", "-o", tmp_path / "c.pt")
    assert code == 0, err
    assert_identical(torch.load(tmp_path / "c.pt", weights_only=True), full)
