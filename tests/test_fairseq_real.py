"""Real fairseq, end to end: fairseq's own trainer writes the shard sets, fsdp-optim reshards and consolidates
them, fairseq resumes and validates, FSDP2 resumes from the DCP export.

fairseq is an optional extra (README "With fairseq / metaseq"); CI installs it. When it is missing this test
fails, naming the install steps: it never skips.

1. ``fairseq-train`` at W=2 (three nested FSDP units, tied embedding, sinusoidal positions held as a
   non-persistent buffer) for 20 updates, saving at 10 and 20;
2. ``fsdp-optim inspect`` names fairseq's optimizer and the unsaved buffer; ``fsdp-optim reshard`` of update
   10 to W=3 and W=1;
3. fairseq resumes each at the new world size, and from its own W=2 set: right after loading, every rank's
   live model shard and optimizer state equal its file; at update 20 the W=2 resume logs the uninterrupted
   validation loss exactly, W=3 and W=1 (other batches per rank) nearly;
4. ``fsdp-optim consolidate --with-model`` of update 20 gives fairscale's own consolidated weights (plus the
   tied name fairscale drops), and ``fairseq-validate`` on it reproduces the loss fairseq logged;
5. ``fsdp-optim convert --to dcp``, and an FSDP2 job at W=2 loads it into fairseq's model and AdamW;
6. the same W=2 training also writes our whole checkpoints (the launcher's ``--fsdp-optim-checkpoints``):
   ``fsdp-optim consolidate`` of update 20 gives the weights and optimizer state of the shard set's
   consolidation bit for bit, fairseq's model built from the saved cfg (no FSDP) loads them with
   ``strict=True``, and ``fairseq-validate`` on it reproduces the loss fairseq logged.
"""

from __future__ import annotations

from pathlib import Path

import _fairseq_real as R
import pytest
import torch
from _dist import run_ranks
from _extras import missing

UPDATES = 20
SET = "checkpoint_1_10"


@pytest.fixture(scope="module")
def fairseq_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    try:
        import fairseq  # noqa: F401
    except ImportError as exc:
        missing(f"fairseq ({exc})", f"install it as CI does: {R.INSTALL}")
    root = tmp_path_factory.mktemp("fairseq")
    data = R.make_data(root)
    logs = {"w2": R.train(data, root / "w2", 2, UPDATES, whole=root / "whole")}
    for w in (3, 1):
        out = R.fsdp_optim("reshard", root / "w2" / SET, "--world-size", w, "-o", root / f"set{w}", log=root / "r.log")
        assert f"{w} shard files" in out, out
    for w, source in ((3, root / "set3"), (1, root / "set1"), (2, root / "w2")):
        logs[f"resume{w}"] = R.train(data, root / f"resume{w}", w, UPDATES, restore=source / f"{SET}.pt")
    return {"root": root, "data": data, "logs": logs}


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_inspect_names_the_optimizer_and_the_unsaved_buffer(fairseq_run) -> None:
    text = R.fsdp_optim("inspect", fairseq_run["root"] / "w2" / SET, "--units", log=fairseq_run["root"] / "i.log")
    for line in ["world size: 2", "units: 3", "optimizer: AdamW (recorded: FairseqAdam / adam)",
                 "buffers: decoder.version; not saved (non-persistent): decoder.embed_positions.weights"]:  # fmt: skip
        assert line in text, (line, text)


@pytest.mark.parametrize("world_size", [3, 1, 2])
def test_fairseq_resumes_with_the_files_state(fairseq_run, world_size) -> None:
    root = fairseq_run["root"]
    source = root / ("w2" if world_size == 2 else f"set{world_size}")
    for rank in range(world_size):
        live = _load(root / f"resume{world_size}" / f"live-{rank}.pt")
        file = _load(source / f"{SET}-shard{rank}.pt")
        assert live["model"].keys() == file["model"].keys()
        for key, value in file["model"].items():
            assert torch.equal(live["model"][key], value), f"W={world_size} rank {rank}: model {key}"
        saved, held = file["last_optimizer_state"], live["optim"]
        assert held["param_groups"] == saved["param_groups"]
        assert held["state"].keys() == saved["state"].keys()
        for pid, entries in saved["state"].items():
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(held["state"][pid][key]), torch.as_tensor(value)), (pid, key)


def test_validation_losses_after_resuming(fairseq_run) -> None:
    losses = {name: R.valid_losses(text) for name, text in fairseq_run["logs"].items()}
    uninterrupted = losses["w2"][UPDATES]
    print(f"valid loss at update {UPDATES}: " + ", ".join(f"{n} {v.get(UPDATES)}" for n, v in losses.items()))
    assert losses["resume2"][UPDATES] == uninterrupted  # the same batches: the same loss
    for name in ("resume3", "resume1"):  # other batches per rank after the resume
        assert abs(float(losses[name][UPDATES]) - float(uninterrupted)) < 0.05, (name, losses)


def test_consolidated_checkpoint_validates_to_the_logged_loss(fairseq_run, tmp_path) -> None:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    root = fairseq_run["root"]
    out = tmp_path / "consolidated.pt"
    R.fsdp_optim("consolidate", root / "w2" / f"checkpoint_1_{UPDATES}", "--with-model", "-o", out, log=tmp_path / "c.log")
    weights = _load(out)["model"]
    shards = [_load(root / "w2" / f"checkpoint_1_{UPDATES}-shard{r}.pt") for r in range(2)]
    metadata = [s["fsdp_metadata"] for s in shards]  # strict=False: fairscale lists the non-persistent buffer too
    theirs = FSDP.consolidate_shard_weights([s["model"] for s in shards], metadata, strict=False)
    assert set(weights) - set(theirs) == {"decoder.output_projection.weight"}  # the tied name fairscale drops
    for name, value in theirs.items():
        assert torch.equal(weights[name], value), name
    text = R.validate(fairseq_run["data"], out)
    logged = R.valid_losses(fairseq_run["logs"]["w2"])[UPDATES]
    validated = R.VALID_LOSS_ALONE.findall(text)
    print(f"fairseq logged {logged} at update {UPDATES}; fairseq-validate on the consolidated checkpoint: {validated}")
    assert validated == [logged], text[-2000:]


def test_fsdp2_resumes_from_the_dcp_export(fairseq_run, tmp_path) -> None:
    root = fairseq_run["root"]
    source = root / "w2" / f"checkpoint_1_{UPDATES}"
    R.fsdp_optim("consolidate", source, "--with-model", "-o", tmp_path / "c.pt", log=tmp_path / "c.log")
    R.fsdp_optim("convert", source, "--to", "dcp", "-o", tmp_path / "dcp", log=tmp_path / "d.log")
    checked = run_ranks(R.fsdp2_resume, 2, tmp_path / "c.pt", tmp_path / "dcp", deadline_s=R.TIMEOUT_S)[0]
    assert checked["weights"] > 30 and checked["optim_params"] > 30, checked


def test_whole_checkpoint_consolidated_validates_as_a_plain_model(fairseq_run, tmp_path) -> None:
    root = fairseq_run["root"]
    assert sorted(p.name for p in (root / "whole").iterdir()) == ["step-00000010", "step-00000020"]
    R.fsdp_optim("consolidate", root / "whole" / f"step-{UPDATES:08d}", "-o", tmp_path / "whole.pt", log=tmp_path / "w.log")
    consolidated = _load(tmp_path / "whole.pt")
    assert consolidated["extra"]["num_updates"] == UPDATES
    R.fsdp_optim("consolidate", root / "w2" / f"checkpoint_1_{UPDATES}", "--with-model", "-o", tmp_path / "set.pt",
                 log=tmp_path / "s.log")  # fmt: skip
    from_set = _load(tmp_path / "set.pt")
    assert consolidated["model"].keys() == from_set["model"].keys()
    for name, value in from_set["model"].items():
        assert torch.equal(consolidated["model"][name], value), f"model {name}: whole and shard-set consolidations differ"
    ours, theirs = consolidated["optimizer"], from_set["last_optimizer_state"]
    by_name = {theirs["param_names"][pid]: entries for pid, entries in theirs["state"].items()}
    assert sorted(ours["param_names"].values()) == sorted(by_name)
    for pid, entries in ours["state"].items():
        want = by_name[ours["param_names"][pid]]
        assert entries.keys() == want.keys()
        for key, value in entries.items():
            f64 = torch.float64 if key == "step" else None  # a step is a number however it is held
            assert torch.equal(torch.as_tensor(value, dtype=f64), torch.as_tensor(want[key], dtype=f64)), key
    model, checkpoint = R.plain_model(consolidated)  # strict=True
    assert not any(name.startswith("_fsdp") or "flat_param" in name for name in model.state_dict())
    torch.save(checkpoint, tmp_path / "plain.pt")
    text = R.validate(fairseq_run["data"], tmp_path / "plain.pt")
    logged = R.valid_losses(fairseq_run["logs"]["w2"])[UPDATES]
    validated = R.VALID_LOSS_ALONE.findall(text)
    print(f"fairseq logged {logged} at update {UPDATES}; fairseq-validate of the whole checkpoint's model: {validated}")
    assert validated == [logged], text[-2000:]
