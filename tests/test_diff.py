"""``fsdp_optim.diff`` / ``fsdp-optim diff``: two sources of one model compared per parameter and state key.

Offline, on real files: the committed format-2 checkpoint (world size 2, Adam, two param groups) and the full dict
its job gathered (``tests/fixtures/v2_adam_w2``), the format-1 one, and what offline ``reshard``, ``convert`` and
``to_safetensors`` make of them. A changed value is made through the full dict (edited, saved, resharded to a
sharded checkpoint), so that every difference is one a real save carries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.core.compare import compare_tensors, ordered_bits

FIXTURES = Path(__file__).parent / "fixtures"
CKPT = FIXTURES / "v2_adam_w2" / "ckpt"
FULL = FIXTURES / "v2_adam_w2" / "full.pt"
V1 = FIXTURES / "v1_adam_w2" / "ckpt"
# parameter id in the full dict -> name, for the ones edited below
BLOCK1_2_WEIGHT, BLOCK1_2_BIAS, NORM_WEIGHT = 3, 4, 9


def _full() -> dict[str, Any]:
    return torch.load(FULL, weights_only=True)


def _resaved(full: dict[str, Any], tmp_path: Path, world_size: int = 3) -> Path:
    """``full`` saved, then resharded offline into a sharded checkpoint at ``world_size`` (the fixture's units)."""
    torch.save(full, tmp_path / "edited.pt")
    fsdp_optim.reshard(tmp_path / "edited.pt", world_size, tmp_path / f"edited_w{world_size}", layout=CKPT)
    return tmp_path / f"edited_w{world_size}"


def _cli(capsys: pytest.CaptureFixture, *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_format_and_world_size_is_bitwise_equal(tmp_path: Path) -> None:
    fsdp_optim.reshard(CKPT, 3, tmp_path / "w3")
    fsdp_optim.reshard(tmp_path / "w3", 1, tmp_path / "w1")
    fsdp_optim.to_safetensors(tmp_path / "w3", tmp_path / "named.safetensors")
    for other in (tmp_path / "w3", tmp_path / "w1", tmp_path / "named.safetensors", FULL, V1, _full()):
        report = fsdp_optim.diff(CKPT, other)
        assert report.equal, report.differences or report.settings
        s = report.summary
        assert (s.params_a, s.params_b, s.tensors, s.tensors_equal, s.scalars) == (18, 18, 32, 32, 16)
        assert (s.max_abs, s.max_rel, s.max_ulp, s.nan_a, s.nan_b) == (0.0, 0.0, 0, 0, 0)
        assert all(r.status == "equal" and r.bitwise_equal for r in report.rows)
    keys = {(r.param, r.key) for r in report.rows}
    assert ("block1.2.weight", "exp_avg_sq") in keys and ("block1.2.weight", "step") in keys


def test_one_changed_value_is_found_where_it_is(tmp_path: Path) -> None:
    full = _full()
    flat = full["state"][BLOCK1_2_WEIGHT]["exp_avg_sq"].view(-1)
    before = flat[5].clone()
    after = before
    for _ in range(3):  # three representable floats up
        after = torch.nextafter(after, torch.tensor(math.inf))
    flat[5] = after
    report = fsdp_optim.diff(CKPT, _resaved(full, tmp_path))
    assert not report.equal and not report.settings
    (row,) = report.differences
    assert (row.param, row.key, row.status, row.numel) == ("block1.2.weight", "exp_avg_sq", "different", 42)
    assert row.max_ulp == 3 and not row.bitwise_equal
    assert row.max_abs == float(after.double() - before.double())
    assert row.max_rel == pytest.approx(row.max_abs / float(after))
    assert report.summary.rows_different == 1 and report.summary.tensors_equal == 31


def test_tolerances_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    full = _full()
    full["state"][BLOCK1_2_BIAS]["exp_avg"].mul_(1 + 1e-4)  # every element, relative 1e-4
    edited = _resaved(full, tmp_path)
    code, out, _ = _cli(capsys, "diff", CKPT, edited)
    assert code == 1 and "block1.2.bias | exp_avg | different" in out and "verdict: different" in out
    code, out, _ = _cli(capsys, "diff", CKPT, edited, "--rtol", "1e-3")
    assert code == 0 and "verdict: equal (atol 0, rtol 0.001)" in out
    within = fsdp_optim.diff(CKPT, edited, rtol=1e-3)
    assert [(r.param, r.key, r.status) for r in within.rows if not r.bitwise_equal] == [
        ("block1.2.bias", "exp_avg", "within tolerance")
    ]
    assert _cli(capsys, "diff", CKPT, edited, "--rtol", "1e-6")[0] == 1
    assert _cli(capsys, "diff", CKPT, edited, "--atol", "1.0")[0] == 0
    assert _cli(capsys, "diff", CKPT, CKPT)[0] == 0
    # bad input: 2 (trouble, as diff(1) and cmp say it) with one line on stderr, as every verb's; bad usage: 2
    code, out, err = _cli(capsys, "diff", CKPT, tmp_path / "nothing")
    assert code == 2 and err.startswith("fsdp-optim: error: ") and "nothing" in err and "Traceback" not in err
    assert out == "" and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit) as negative:  # a tolerance below 0 is bad usage, refused before reading
        main(["diff", str(CKPT), str(edited), "--atol", "-1"])
    assert negative.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        main(["diff", str(CKPT)])
    assert exit_.value.code == 2


def test_nan_counts_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    full = _full()
    full["state"][BLOCK1_2_BIAS]["exp_avg"].view(-1)[2] = math.nan
    full["state"][BLOCK1_2_BIAS]["exp_avg"].view(-1)[3] = math.inf
    nan_b = _resaved(full, tmp_path)
    row = next(r for r in fsdp_optim.diff(CKPT, nan_b).rows if (r.param, r.key) == ("block1.2.bias", "exp_avg"))
    assert (row.nan_a, row.nan_b, row.inf_a, row.inf_b, row.max_abs) == (0, 1, 0, 1, math.inf)
    # the same NaN on both sides is no difference; its count is reported on each
    same = fsdp_optim.diff(nan_b, tmp_path / "edited.pt")
    assert same.equal and (same.summary.nan_a, same.summary.nan_b, same.summary.inf_a) == (1, 1, 1)
    code, out, _ = _cli(capsys, "diff", CKPT, nan_b, "--json")
    record = json.loads(out)
    assert code == 1 and record["equal"] is False and record["summary"]["max_abs"] == "inf"
    (shown,) = [r for r in record["rows"] if r["status"] != "equal"]
    assert (shown["param"], shown["key"], shown["nan_b"], shown["inf_b"]) == ("block1.2.bias", "exp_avg", 1, 1)


def test_settings_steps_and_one_sided_parameters(tmp_path: Path) -> None:
    full = _full()
    full["param_groups"][1]["lr"] = 0.03
    full["param_groups"][0]["betas"] = (0.8, 0.999)
    full["state"][NORM_WEIGHT]["step"] = torch.tensor(5.0)
    del full["state"][BLOCK1_2_BIAS]["exp_avg_sq"]
    report = fsdp_optim.diff(CKPT, full)
    settings = {(d.group, d.key): (d.a, d.b) for d in report.settings}
    assert settings == {(1, "lr"): ("0.02", "0.03"), (0, "betas"): ("(0.9, 0.999)", "(0.8, 0.999)")}
    rows = {(r.param, r.key): r for r in report.differences}
    assert set(rows) == {("norm.weight", "step"), ("block1.2.bias", "exp_avg_sq")}
    step = rows["norm.weight", "step"]
    assert step.scalar and step.max_abs == 3.0 and step.detail == "2.0 (torch.float32) in a, 5.0 (torch.float32) in b"
    assert rows["block1.2.bias", "exp_avg_sq"].status == "only in a"
    # a parameter on one side only
    full = _full()
    pid = full["param_groups"][0]["params"].pop()  # head.bias
    name = full["param_names"].pop(pid)
    full["state"].pop(pid)
    report = fsdp_optim.diff(full, CKPT)
    assert [(r.param, r.status) for r in report.differences] == [(name, "only in b")]
    assert [(d.group, d.key) for d in report.settings] == [(0, "params")]
    assert "'head.bias' only in b" in report.settings[0].b


def test_streams_one_tensor_of_each_side_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsdp_optim.offline.per_param as per_param

    made = []
    real = per_param.assemble_full

    def one_at_a_time(plan: Any, *args: Any, **kwargs: Any) -> Any:
        assert len(plan.flats) == 1, f"a restricted plan holds one parameter, found {len(plan.flats)}"
        (flat,) = plan.flats.values()
        assert len(flat.entries) == 1, f"and one state key, found {[e.key for e in flat.entries]}"
        made.append(flat.entries[0].key)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(per_param, "assemble_full", one_at_a_time)
    fsdp_optim.reshard(CKPT, 3, tmp_path / "w3")
    assert fsdp_optim.diff(CKPT, tmp_path / "w3").equal
    assert len(made) == 2 * 32  # each (parameter, tensor key) once per side; scalars come from the plan


def test_compare_tensors_ulp_and_signed_zero() -> None:
    a = torch.tensor([0.0, 1.0, torch.finfo(torch.float32).max, -1.0])
    b = torch.tensor([-0.0, 1.0, math.inf, torch.nextafter(torch.tensor(-1.0), torch.tensor(0.0)).item()])
    stats = compare_tensors(a, b)
    assert not stats.bitwise_equal and not stats.close  # +inf vs max float: not close at any finite tolerance
    assert stats.max_ulp == 1 and stats.inf_b == 1 and stats.max_abs == math.inf
    zero = compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not zero.bitwise_equal and zero.close and (zero.max_abs, zero.max_ulp) == (0.0, 0)
    assert ordered_bits(torch.tensor([-0.0, 0.0, -1.0, 1.0])).tolist()[:2] == [0, 0]
    wide = compare_tensors(torch.tensor([-1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
    assert wide.max_ulp == 2 * 0x3FF0000000000000 and wide.max_abs == 2.0
    half = compare_tensors(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0078125], dtype=torch.bfloat16))
    assert half.max_ulp == 1


def _shards_job(rank: int, world_size: int, out: str) -> None:
    """A world-size-2 job (gloo, our class, Adam over two param groups): a metaseq-style shard set and the full dict."""
    import _fairseq as F
    import _models as M

    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    for step in range(2):
        M.train_step(root, optim, *M.local_batch(step, rank, world_size))
    full = fsdp_optim.gather_full_optim_state_dict(root, optim)
    if rank == 0:
        torch.save(full, Path(out) / "full.pt")
    state = F.checkpoint_dict(root, optim, flavour="metaseq", num_updates=2, loss_scale=None)
    F.save_shard(state, Path(out) / "shards" / F.PREFIX, rank)


def test_a_shard_set_against_its_full_dict_and_its_reshard(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import _fairseq as F
    from _dist import run_ranks

    from fsdp_optim.fairseq import reshard_shards

    run_ranks(_shards_job, 2, str(tmp_path))
    shards = tmp_path / "shards" / F.PREFIX
    reshard_shards(shards, 3, tmp_path / "w3")
    (resharded,) = {p.name.split("-shard")[0] for p in (tmp_path / "w3").iterdir() if "-shard" in p.name}
    report = fsdp_optim.diff(shards, tmp_path / "w3" / resharded)
    assert report.equal and report.summary.tensors == 32, report.differences or report.settings
    # Against the job's own full dict every value is equal; the set records fairseq's optimizer, whose torch class
    # is AdamW, where the full dict says Adam: a setting that differs, and diff says so.
    report = fsdp_optim.diff(shards, tmp_path / "full.pt")
    assert report.summary.rows_different == 0 and report.summary.tensors_equal == 32
    assert [(d.key, d.a, d.b) for d in report.settings] == [("optimizer", "AdamW", "Adam")]
    assert fsdp_optim.verify(shards, deep=True).ok
    assert _cli(capsys, "diff", tmp_path / "w3" / resharded, shards)[0] == 0
    assert _cli(capsys, "diff", tmp_path / "w3" / resharded, tmp_path / "full.pt")[0] == 1


def test_relative_error_against_a_zero_is_infinite_not_the_largest_float() -> None:
    from fsdp_optim.core.compare import compare_tensors

    stats = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0]))
    assert stats.max_rel == float("inf") and stats.max_abs == 1.0
