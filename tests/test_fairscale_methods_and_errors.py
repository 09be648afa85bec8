"""fairscale's own FSDP class and its own optimizer-state methods under ``host_execution()``, and the errors and
warnings a user meets, each on real checkpoints written by one real world-size-2 job.

The job (one spawn, gloo, tiny ``_models.Net``):

- fairscale's own class inside ``host_execution()``, Adam, one group: fairscale's ``gather_full_optim_state_dict``
  and ``get_shard_from_optim_state_dict`` (theirs, not ours) are used as its README would have a user use them,
  and training resumed from each must match plain Adam;
- a save into a directory of other files, and a load from a mistyped directory: every rank reports;
- everything the job does records its warnings (fairscale's and torch's deprecations must not appear);
- our class writes a sharded checkpoint, a full dict and a metaseq-style shard set for the offline checks.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import _fairseq as F
import _models as M
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import fsdp_optim
from fsdp_optim.cli import main

SAVE_AT, TOTAL = 3, 6
DEPRECATIONS = ("TypedStorage is deprecated", "_all_gather_base", "_reduce_scatter_base")


def _fairscale_nest(net: torch.nn.Module) -> torch.nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    for path in M.NESTINGS["deep"]:
        parent_path, _, name = path.rpartition(".")
        parent = net.get_submodule(parent_path) if parent_path else net
        setattr(parent, name, FairscaleFSDP(getattr(parent, name)))
    return FairscaleFSDP(net)


def _adam(root: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(root.parameters(), lr=0.01)  # fairscale's own gather takes one group only


def _finish(root: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, world_size: int) -> dict[str, Any]:
    for step in range(SAVE_AT, TOTAL):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    return {k: v.clone() for k, v in root.state_dict().items()}


def _theirs(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """fairscale's class and fairscale's two methods, under the switch."""
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    result: dict[str, Any] = {}
    with fsdp_optim.host_execution():
        root = _fairscale_nest(M.make_net())
        optim = _adam(root)
        for step in range(SAVE_AT):
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        weights = root.state_dict()  # a collective: the weights every resume starts from
        if rank == 0:
            torch.save(weights, out / "model_at_save.pt")
        native = FairscaleFSDP.gather_full_optim_state_dict(root, optim)
        result["live_steps"] = sorted({type(s["step"]).__name__ for s in optim.state.values()})
        if rank == 0:
            torch.save(native, out / "native.pt")
            fsdp_optim.save_layout(root, out / "layout.pt")
        dist.barrier()
        native = torch.load(out / "native.pt", weights_only=True)
        result["uninterrupted"] = _finish(root, optim, rank, world_size)
        resumed = _adam(root)
        resumed.load_state_dict(root.get_shard_from_optim_state_dict(copy.deepcopy(native)))  # theirs
        result["theirs"] = _resume_weights(root, resumed, rank, world_size, out)
        resumed = _adam(root)
        resumed.load_state_dict(fsdp_optim.get_shard_from_optim_state_dict(root, native, optim=resumed))
        result["ours"] = _resume_weights(root, resumed, rank, world_size, out)
    return result


def _resume_weights(root: Any, optim: Any, rank: int, world_size: int, out: Path) -> dict[str, Any]:
    """Train ``optim`` on from the weights saved at step SAVE_AT (rank 0 wrote them) to TOTAL."""
    root.load_state_dict(torch.load(out / "model_at_save.pt", weights_only=True))
    return _finish(root, optim, rank, world_size)


def _errors(rank: int, root: Any, optim: Any, out: Path) -> dict[str, tuple[str, str]]:
    """What each rank raises for a save into a folder of other files and a load from a mistyped directory."""
    found: dict[str, tuple[str, str]] = {}
    foreign = out / "foreign"
    foreign.mkdir(exist_ok=True)
    if rank == 0:
        (foreign / "notes.txt").write_text("someone else's")
    dist.barrier()
    for name, call in {
        "foreign": lambda: fsdp_optim.save_sharded_optim_state(root, optim, foreign),
        "typo": lambda: fsdp_optim.load_sharded_optim_state(root, optim, out / "ckpt-typo"),
    }.items():
        try:
            call()
            found[name] = ("nothing", "")
        except Exception as exc:
            found[name] = (type(exc).__name__, str(exc))
    return found


def _ours(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    root = M.wrap(M.make_net(), "deep")
    optim = _adam(root)
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    fsdp_optim.save_sharded_optim_state(root, optim, out / "ckpt")
    full = fsdp_optim.gather_full_optim_state_dict(root, optim)
    if rank == 0:
        torch.save(full, out / "full.pt")
    prefix = out / "shards" / F.PREFIX
    F.save_shard(F.checkpoint_dict(root, optim, flavour="metaseq", num_updates=2, loss_scale=None), prefix, rank)
    dist.barrier()
    loaded = _adam(root)
    shard_set: tuple[str, str]
    try:
        fsdp_optim.load_sharded_optim_state(root, loaded, prefix)
        shard_set = ("loaded", "")
    except Exception as exc:
        shard_set = (type(exc).__name__, str(exc))
    return {"errors": _errors(rank, root, optim, out), "shard_set": shard_set}


def _job(rank: int, world_size: int, out: str) -> dict[str, Any]:
    directory = Path(out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters_before = list(warnings.filters)
        result = _theirs(rank, world_size, directory)
        result.update(_ours(rank, world_size, directory))
        result["filters_added"] = [str(f) for f in warnings.filters if f not in filters_before]
    result["warnings"] = [str(w.message) for w in caught]
    return result


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("sharp")
    return out, run_ranks(_job, 2, str(out))


def _plain_adam_weights(steps: int) -> dict[str, torch.Tensor]:
    net = M.make_net()
    optim = torch.optim.Adam(net.parameters(), lr=0.01)
    M.train_plain("adam", range(steps), net=net, optim=optim)
    return net.state_dict()


# ---------------------------------------------------------------------------------------------------
# fairscale's own methods under the switch


def test_fairscale_own_gather_and_get_shard_under_the_switch_match_plain_adam(job) -> None:
    out, results = job
    native = torch.load(out / "native.pt", weights_only=True)
    moments = [s for s in native["state"].values() if "exp_avg" in s and s["exp_avg"].abs().sum() > 0]
    assert moments and not any(torch.equal(s["exp_avg"], s["exp_avg_sq"]) for s in moments)
    plain = _plain_adam_weights(TOTAL)
    for r in results:
        assert r["live_steps"] == ["Tensor"], "fairscale's gather turned the live optimizer's step into a number"
        for how in ("uninterrupted", "theirs", "ours"):
            for name, want in plain.items():
                got = r[how][name]
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{how} {name}: {m}")


def test_a_fairscale_dict_whose_moments_are_byte_identical_is_refused_naming_the_check(job, capsys, tmp_path) -> None:
    out, _ = job
    native = torch.load(out / "native.pt", weights_only=True)
    for entries in native["state"].values():
        if "exp_avg" in entries:
            entries["exp_avg"] = entries["exp_avg_sq"].clone()  # what fairscale's CPU gather used to return
    torch.save(native, tmp_path / "broken.pt")
    before = (tmp_path / "broken.pt").read_bytes()
    argv = ["--layout", str(out / "layout.pt"), "--optimizer", "Adam", "-o", str(tmp_path / "full.pt")]
    assert main(["convert", str(tmp_path / "broken.pt"), *argv]) == 1
    err = capsys.readouterr().err
    assert "byte-identical" in err and "'exp_avg' and 'exp_avg_sq'" in err and "plausibility check" in err, err
    assert (tmp_path / "broken.pt").read_bytes() == before and not (tmp_path / "full.pt").exists()
    assert main(["convert", str(out / "native.pt"), *argv]) == 0, capsys.readouterr().err  # the real one converts


# ---------------------------------------------------------------------------------------------------
# Errors on every rank: same type, the user's own terms


def test_every_rank_raises_the_same_type_for_a_foreign_output(job) -> None:
    _, results = job
    kinds = {r["errors"]["foreign"][0] for r in results}
    assert kinds == {"ForeignOutputError"}, [r["errors"]["foreign"] for r in results]
    assert all("notes.txt" in r["errors"]["foreign"][1] for r in results), [r["errors"]["foreign"] for r in results]


def test_a_mistyped_directory_names_the_path_on_every_rank(job) -> None:
    _, results = job
    for rank, r in enumerate(results):
        kind, message = r["errors"]["typo"]
        assert kind == "FileNotFoundError", (rank, kind, message)
        assert "ckpt-typo" in message and "scatter_full_optim_state" not in message and "refused the full dict" not in message


def test_a_shard_set_prefix_is_named_as_one_by_load(job) -> None:
    _, results = job
    for r in results:
        kind, message = r["shard_set"]
        assert kind == "loaded" or ("shard set" in message and "no such file" not in message), r["shard_set"]


# ---------------------------------------------------------------------------------------------------
# Noise


def test_no_deprecation_warnings_from_fairscale_or_torch_and_no_global_filters(job) -> None:
    _, results = job
    for r in results:
        noisy = [w for w in r["warnings"] if any(d in w for d in DEPRECATIONS)]
        assert not noisy, noisy
        ours = [f for f in r["filters_added"] if any(d in f for d in DEPRECATIONS)]
        assert not ours, ours  # filtered inside our calls only, never process-wide


def test_cli_full_dict_without_layout_asks_for_what_the_cli_takes(job, capsys) -> None:
    out, _ = job
    code = main(["reshard", str(out / "full.pt"), "--world-size", "3", "-o", str(out / "ws3")])
    err = capsys.readouterr().err
    assert code == 1 and "--layout" in err and "FSDP model" not in err, err
