"""fairseq / metaseq shard sets written by real fairscale FSDP jobs at world sizes 2 and 3 (tests/_fairseq.py).

Two sets per world size: "groups" (flat units, two param groups, ``loss_scale``, metaseq's
``shard_metadata``) and "unflat" (every unit unflattened, one group, fairseq main's ``fsdp_metadata`` and a
``cfg`` holding an ``argparse.Namespace``).

- consolidate: the optimizer's full dict equals our gather of the same live state, bit for bit; the extras
  and every other key are kept; the model's full weights equal the unwrapped model's;
- reshard 3 -> 2 and 2 -> 3: same names, keys and format; fairscale FSDP at the new world size loads the
  files with ``load_local_state_dict`` + ``optimizer.load_state_dict`` and ends where uninterrupted training ends;
- refusals (a missing shard, shards of different saves, metadata that does not match the tensors, a class
  that weights_only loading refuses): a ``ValueError`` naming the file, and nothing written;
- the id matcher and the streaming writer, as pure functions; the command line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import _fairseq as F
import _models as M
import pytest
import torch
from _checks import assert_full_matches_plain, assert_identical

import fsdp_optim
from fsdp_optim import ForeignOutputError
from fsdp_optim.cli import main
from fsdp_optim.core.layout import shard_bounds
from fsdp_optim.disk.stream_save import Pending, stream_save
from fsdp_optim.fairseq import OPTIM_KEY, ShardSet, consolidate_shards, reshard_shards
from fsdp_optim.formats.fairseq.checks import match_optimizer_ids

REL = 1e-4
ORDER = [name for name, _ in M.make_net().named_parameters()]  # the unwrapped model's, as gather numbers them


def _skip_unused(name: str) -> bool:
    return name.startswith("unused.")  # a flat parameter gives it state; see README "Known limits"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> F.Jobs:
    return F.run_jobs(tmp_path_factory.mktemp("fairseq"))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)  # our own test files


# ---------------------------------------------------------------------------------------------------
# consolidate


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(F.VARIANTS))
def test_consolidate_equals_gather_and_keeps_everything(jobs, name, world_size) -> None:
    prefix = jobs.prefix(name, world_size)
    out = consolidate_shards(prefix, param_order=ORDER, optimizer="Adam")
    full = out[OPTIM_KEY]
    extras = {"loss_scale": F.LOSS_SCALE} if F.VARIANTS[name]["loss_scale"] else {}
    assert {k: full[k] for k in extras} == extras
    assert_identical({k: v for k, v in full.items() if k not in extras}, jobs.gathered[world_size][name], name)

    rank0 = _load(prefix.parent / f"{prefix.name}-shard0.pt")
    meta_key = "shard_metadata" if F.VARIANTS[name]["flavour"] == "metaseq" else "fsdp_metadata"
    assert list(out) == [k for k in rank0 if k not in ("model", meta_key)]
    for key in out:
        if key != OPTIM_KEY:
            assert_identical(out[key], rank0[key], key)

    # Without the model's order, parameters follow the files' order: the same state under the same names.
    plain, ours = fsdp_optim.to_named(fsdp_optim.consolidate(prefix)), fsdp_optim.to_named(full)
    assert_identical(dict(sorted(plain["state"].items())), dict(sorted(ours["state"].items())))
    assert [{**g, "params": sorted(g["params"])} for g in plain["param_groups"]] == [
        {**g, "params": sorted(g["params"])} for g in ours["param_groups"]
    ]


def test_consolidate_with_model_gives_the_unwrapped_weights(jobs) -> None:
    for name in F.VARIANTS:
        model = consolidate_shards(jobs.prefix(name, 3), with_model=True)["model"]
        expected = F.reference(name, F.SAVE_AT)[0].state_dict()
        assert set(model) == set(expected)  # the tied head.weight too, as the same tensor
        assert model["head.weight"] is model["embed.weight"]
        for key, value in expected.items():
            atol = REL * float(value.abs().max())
            torch.testing.assert_close(model[key], value, rtol=REL, atol=atol, msg=lambda m: f"{name} {key}: {m}")


# ---------------------------------------------------------------------------------------------------
# reshard


@pytest.mark.parametrize("source, target", [(3, 2), (2, 3)], ids=["3to2", "2to3"])
@pytest.mark.parametrize("name", list(F.VARIANTS))
def test_reshard_keeps_the_format(jobs, name, source, target) -> None:
    src = jobs.prefix(name, source)
    out = jobs.root / f"{name}-{source}to{target}"
    assert sorted(p.name for p in out.iterdir()) == [f"{F.PREFIX}-shard{r}.pt" for r in range(target)]
    before, shards = _load(src.parent / f"{F.PREFIX}-shard0.pt"), ShardSet(src)
    meta_key = shards.metadata_key
    for rank in range(target):
        after = _load(out / f"{F.PREFIX}-shard{rank}.pt")
        assert list(after) == list(before)
        for key in before:
            if key not in ("model", OPTIM_KEY, meta_key):
                assert_identical(after[key], before[key], key)  # carried from rank 0 unchanged
        assert list(after["model"]) == list(before["model"])
        optim = after[OPTIM_KEY]
        assert list(optim) == list(before[OPTIM_KEY]) and optim["param_groups"] == before[OPTIM_KEY]["param_groups"]
        assert list(optim["state"]) == list(before[OPTIM_KEY]["state"])
        for flat, backing in enumerate(shards.backings):
            bounds = shard_bounds(backing.numel, target, rank)
            info = after[meta_key]["param_metadata"][backing.instance]["params"][backing.name]
            assert info["padding"] == bounds.padding, (backing.key, rank)
            assert after["model"][backing.key].shape == (bounds.numel,), backing.key
            pid = shards.id_of_flat.get(flat)
            for value in optim["state"].get(pid, {}).values():
                assert value.shape == (bounds.numel,) if value.dim() else value == F.SAVE_AT
        if "head.weight" in after["model"]:  # unflattened: the tied name shares the embedding's storage
            assert after["model"]["head.weight"].data_ptr() == after["model"]["embed.weight"].data_ptr()
    # Nothing lost: the resharded set consolidates to the same state and weights.
    again = consolidate_shards(out / F.PREFIX, with_model=True, param_order=ORDER, optimizer="Adam")
    first = consolidate_shards(src, with_model=True, param_order=ORDER, optimizer="Adam")
    assert again[OPTIM_KEY]["fsdp_optim"].pop("world_size") == target
    assert first[OPTIM_KEY]["fsdp_optim"].pop("world_size") == source
    assert_identical(again[OPTIM_KEY], first[OPTIM_KEY])
    assert_identical(again["model"], first["model"])


@pytest.mark.parametrize("source, target", [(3, 2), (2, 3)], ids=["3to2", "2to3"])
@pytest.mark.parametrize("name", list(F.VARIANTS))
def test_fairscale_resumes_from_resharded_files(jobs, name, source, target) -> None:
    final = jobs.fairscale[(source, target)][name]
    net, plain = F.reference(name)
    if final["model"] is not None:
        for key, value in net.state_dict().items():
            if not _skip_unused(key):
                atol = REL * float(value.abs().max())
                torch.testing.assert_close(final["model"][key], value, rtol=REL, atol=atol, msg=lambda m: f"{key}: {m}")
    assert_full_matches_plain(final["optim"], plain.state_dict(), skip=_skip_unused, rel=REL)


# ---------------------------------------------------------------------------------------------------
# refusals: the file named, nothing written


def _copy(jobs: F.Jobs, name: str, world_size: int, tmp_path: Path, into: str = "set") -> Path:
    dst = tmp_path / into
    shutil.copytree(jobs.prefix(name, world_size).parent, dst)
    return dst / F.PREFIX


def _refused(prefix: Path, tmp_path: Path, match: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        reshard_shards(prefix, 2, out)
    with pytest.raises(ValueError, match=match):
        fsdp_optim.to_dcp(prefix, tmp_path / "dcp")
    with pytest.raises(ValueError, match=match):
        consolidate_shards(prefix)
    assert not out.exists() and not (tmp_path / "dcp").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def _edit(path: Path, change) -> None:
    state = _load(path)
    change(state)
    torch.save(state, path)


def test_missing_shard_is_named(jobs, tmp_path) -> None:
    prefix = _copy(jobs, "groups", 3, tmp_path)
    (prefix.parent / f"{F.PREFIX}-shard1.pt").unlink()
    _refused(prefix, tmp_path, r"-shard1\.pt: missing from the shard set \(found shards \[0, 2\]\)")
    # The last shard gone leaves a set whose shards are cut for 3 ranks: the sizes say so.
    shutil.copy(jobs.prefix("groups", 3).parent / f"{F.PREFIX}-shard1.pt", prefix.parent)
    (prefix.parent / f"{F.PREFIX}-shard2.pt").unlink()
    _refused(
        prefix, tmp_path, r"-shard0\.pt: 'model' holds 'flat_param_0' as \[34\], .* expected \[51\] \(the set has 2"
    )


def test_shards_of_different_saves_are_named(jobs, tmp_path) -> None:
    prefix = _copy(jobs, "groups", 2, tmp_path)
    later = jobs.prefix("later", 2)
    shutil.copy(later.parent / f"{later.name}-shard1.pt", prefix.parent / f"{F.PREFIX}-shard1.pt")
    _refused(prefix, tmp_path, r"-shard1\.pt: num_updates is 3, .*-shard0\.pt has 2 \(shards of different saves")
    # The same without the history: the optimizer's step tells them apart.
    for rank in range(2):
        _edit(prefix.parent / f"{F.PREFIX}-shard{rank}.pt", lambda s: s.pop("optimizer_history"))
    _refused(prefix, tmp_path, r"-shard1\.pt: optimizer state 'step' of id 0 is 3\.0 .*-shard0\.pt has 2\.0")


def test_metadata_that_does_not_match_the_tensors_is_named(jobs, tmp_path) -> None:
    prefix = _copy(jobs, "groups", 2, tmp_path)
    shard1 = prefix.parent / f"{F.PREFIX}-shard1.pt"

    def truncate(state: dict) -> None:
        state["model"]["block1.flat_param_0"] = state["model"]["block1.flat_param_0"][:-1].clone()

    _edit(shard1, truncate)
    _refused(prefix, tmp_path, r"-shard1\.pt: 'model' holds 'block1.flat_param_0' as \[48\], .* expected \[49\]")
    shutil.copy(jobs.prefix("groups", 2).parent / shard1.name, shard1)

    def pad(state: dict) -> None:
        state["shard_metadata"]["param_metadata"][1]["params"]["flat_param_0"]["padding"] = 0

    _edit(shard1, pad)
    _refused(prefix, tmp_path, r"-shard1\.pt: the metadata gives 'block1.flat_param_0' padding 0, expected 1")
    shutil.copy(jobs.prefix("groups", 2).parent / shard1.name, shard1)

    def optimizer_state(state: dict) -> None:
        entries = state[OPTIM_KEY]["state"][1]
        entries["exp_avg"] = entries["exp_avg"][:-1].clone()

    _edit(shard1, optimizer_state)
    _refused(prefix, tmp_path, r"-shard1\.pt: optimizer state 'exp_avg' of id 1 is a tensor torch.float32\[48\]")


def test_foreign_classes_are_refused_unless_allowed(jobs, tmp_path) -> None:
    prefix = _copy(jobs, "unflat", 2, tmp_path)
    for rank in range(2):
        _edit(prefix.parent / f"{F.PREFIX}-shard{rank}.pt", lambda s: s["cfg"].update(task=F.Marker("lm")))
    _refused(prefix, tmp_path, r"-shard0\.pt: holds objects of _fairseq\.Marker, which weights_only loading refuses")
    out = consolidate_shards(prefix, allow_globals=["_fairseq.Marker"])
    assert isinstance(out["cfg"]["task"], F.Marker) and out["cfg"]["model"].arch == "transformer_lm"


def test_output_over_the_source_is_refused(jobs, tmp_path) -> None:
    prefix = _copy(jobs, "groups", 2, tmp_path)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in prefix.parent.iterdir())
    with pytest.raises(ValueError, match="out_dir: .* holds the source shards"):
        reshard_shards(prefix, 3, prefix.parent)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in prefix.parent.iterdir()) == before


def test_reshard_over_an_older_set_needs_overwrite(jobs, tmp_path) -> None:
    out = tmp_path / "out"
    reshard_shards(jobs.prefix("groups", 2), 3, out)
    (out / "notes.txt").write_text("mine")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with pytest.raises(ForeignOutputError, match=r"out: already holds checkpoint_2-model_part-0-shard<r>.pt files"):
        reshard_shards(jobs.prefix("groups", 3), 2, out)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before
    reshard_shards(jobs.prefix("groups", 3).parent / f"{F.PREFIX}-shard2.pt", 2, out, overwrite=True)  # any shard file
    assert sorted(p.name for p in out.iterdir()) == [f"{F.PREFIX}-shard0.pt", f"{F.PREFIX}-shard1.pt", "notes.txt"]
    assert ShardSet(out / F.PREFIX).world_size == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, no staging left


# ---------------------------------------------------------------------------------------------------
# pure pieces


def test_optimizer_ids_are_matched_or_refused() -> None:
    # Two groups listing flats in file order: [0, 2] and [1]; flat 3 holds no state (frozen).
    assert match_optimizer_ids([[10, 11], [12]], {10: 5, 11: 7, 12: 6}, [5, 6, 7, 9], label="set") == {
        10: 0,
        11: 2,
        12: 1,
    }
    # An id without state takes whatever flat is left where it must sit.
    assert match_optimizer_ids([[0, 1, 2]], {0: 5, 2: 7}, [5, 4, 7], label="set") == {0: 0, 1: 1, 2: 2}
    with pytest.raises(ValueError, match="set: cannot tell which FSDP parameters .* several assignments"):
        match_optimizer_ids([[0]], {0: 4}, [4, 4], label="set")
    with pytest.raises(ValueError, match=r"set: the optimizer's param groups \(sizes \[2\]\) do not fit"):
        match_optimizer_ids([[0, 1]], {0: 4, 1: 9}, [4, 5], label="set")


def test_stream_save_writes_what_torch_load_reads(tmp_path) -> None:
    made = []

    def make(value: float) -> torch.Tensor:
        made.append(value)
        return torch.full((2, 3), value)

    shared = Pending((2, 3), torch.float32, lambda: make(1.0))
    real = torch.arange(4.0)
    obj = {"a": shared, "b": shared, "c": Pending((5,), torch.bfloat16, lambda: torch.ones(5, dtype=torch.bfloat16)),
           "d": real, "e": real[1:], "cfg": {"lr": [0.1], "name": "x"}}  # fmt: skip
    stream_save(obj, tmp_path / "x.pt")
    assert made == [1.0]  # one storage for a Pending placed twice
    for mmap in (False, True):
        back = torch.load(tmp_path / "x.pt", weights_only=True, mmap=mmap)
        assert_identical(back["a"], torch.full((2, 3), 1.0))
        assert back["a"].data_ptr() == back["b"].data_ptr() and back["e"].data_ptr() == back["d"].data_ptr() + 4
        assert_identical(back["c"], torch.ones(5, dtype=torch.bfloat16))
        assert back["cfg"] == obj["cfg"] and torch.equal(back["e"], real[1:])


# ---------------------------------------------------------------------------------------------------
# command line


def _run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli(jobs, tmp_path, capsys) -> None:
    shard = jobs.prefix("groups", 2).parent / f"{F.PREFIX}-shard1.pt"
    code, text, err = _run(capsys, "inspect", shard, "--units")
    assert code == 0 and err == "", err
    for line in ["format: fairseq/metaseq shard set (shard_metadata)", "world size: 2", "param groups: 2",
                 "optimizer extras: loss_scale=64.0", "other keys: cfg, criterion, optimizer_history",
                 "block2.inner | 3 | 4 | 66 | 2 | [0, 0] | float32 | step,exp_avg,exp_avg_sq"]:  # fmt: skip
        assert line in text, (line, text)

    code, text, err = _run(capsys, "consolidate", jobs.prefix("unflat", 3), "-o", tmp_path / "c.pt")  # weights kept
    assert code == 0 and "a consolidated fairseq checkpoint" in text, err
    assert_identical(
        _load(tmp_path / "c.pt")["model"], consolidate_shards(jobs.prefix("unflat", 3), with_model=True)["model"]
    )

    code, text, err = _run(capsys, "reshard", shard, "--world-size", 3, "-o", tmp_path / "r3")
    assert code == 0 and "3 shard files" in text, err
    assert ShardSet(tmp_path / "r3" / F.PREFIX).world_size == 3

    code, text, err = _run(capsys, "convert", shard, "--to", "dcp", "-o", tmp_path / "dcp")
    assert code == 0 and "optimizer extras under 'optimizer_extra': loss_scale" in text, err

    (tmp_path / "r3" / f"{F.PREFIX}-shard1.pt").unlink()
    code, text, err = _run(capsys, "reshard", tmp_path / "r3" / F.PREFIX, "--world-size", 2, "-o", tmp_path / "bad")
    assert code == 1 and f"{F.PREFIX}-shard1.pt: missing from the shard set" in err and not (tmp_path / "bad").exists()


def test_cli_help_lists_the_formats(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fairseq/metaseq shard sets" in text and "PyTorch DCP (convert --to dcp)" in text
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "{full,named,dcp,safetensors}" in capsys.readouterr().out
