"""``verify --deep`` and ``diff`` by a team of 2 processes (``verify(..., parallel=True)``, ``diff(..., parallel=True)``
on a real gloo group, and the CLI as ``torchrun`` starts it): the state's reading split by bytes, each state tensor
made by exactly one process, the report (text and JSON) the one one process makes, a damaged chunk found by either
process failing both with its message, and a killed process failing the other fast.

The checkpoints are real files: four units of 65,539 float32 elements at world size 2, so each rank file holds
several 64 KiB chunks and a byte flipped in one unit's range is read by one process only.
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import free_port, run_ranks
from test_recut_blocks import _full

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.split import split_by_bytes
from fsdp_optim.offline.deep import deep_work
from fsdp_optim.offline.diff import diff
from fsdp_optim.offline.verify import report_json, verify

ROOT = Path(__file__).resolve().parent.parent
NUMEL = 65536  # each unit's weight: 256 KiB of each state key, 2 chunks per rank file and key


def _layout(world_size: int) -> ModelLayout:
    flats, names = [], []
    for u in range(4):
        w, b = ParamSpec(f"u{u}.w", (NUMEL,), 0), ParamSpec(f"u{u}.b", (3,), NUMEL)
        flats.append(FlatParamLayout(f"u{u}", (w, b), world_size, 0, torch.float32, True))
        names += [w.name, b.name]
    return ModelLayout(tuple(flats), tuple(names), world_size, 0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``src`` (world size 2), ``sick`` (a NaN in u0.w's exp_avg, a negative exp_avg_sq in u3.b, checksums
    matching), ``other`` (one value of u2.w changed, world size 3) and ``named`` (src as a named safetensors file)."""
    root = tmp_path_factory.mktemp("reading")
    full = _full(_layout(2))
    fsdp_optim.reshard(full, 2, root / "src", layout=_layout(2))
    sick = _full(_layout(2))
    sick["state"][0]["exp_avg"][5] = math.nan  # u0.w
    sick["state"][7]["exp_avg_sq"][1] = -1.0  # u3.b
    fsdp_optim.reshard(sick, 2, root / "sick", layout=_layout(2))
    full["state"][4]["exp_avg"][7] += 1.0  # u2.w
    fsdp_optim.reshard(full, 3, root / "other", layout=_layout(2))
    fsdp_optim.to_safetensors(root / "src", root / "named.safetensors")
    return {name: root / name for name in ("src", "sick", "other", "named.safetensors")}


def _owners(path: Path) -> dict[tuple[str, str], int]:
    """Which process of 2 reads each state tensor of ``path`` in ``verify --deep``, by the split itself."""
    with deep_work(path) as work:
        split = split_by_bytes([p.nbytes for p in work.pieces], 2)
        return {
            piece.reads: owner for owner, run in enumerate(split.runs) for i in run
            if (piece := work.pieces[i]).reads is not None and piece.nbytes
        }  # fmt: skip


def _made(call: Any) -> tuple[Any, list[tuple[str, str]]]:
    """``call()`` and the state tensors this process made (every ``PerParameter.tensor`` call)."""
    from fsdp_optim.offline.per_param import PerParameter

    made: list[tuple[str, str]] = []
    real = PerParameter.tensor

    def counted(self: PerParameter, name: str, key: str) -> torch.Tensor:
        made.append((name, key))
        return real(self, name, key)

    PerParameter.tensor = counted  # type: ignore[method-assign]
    try:
        return call(), made
    finally:
        PerParameter.tensor = real  # type: ignore[method-assign]


def _deep_in_ranks(rank: int, world_size: int, path: str) -> tuple[dict[str, object], list[tuple[str, str]]]:  # noqa: ARG001
    return _made(lambda: report_json(verify(path, deep=True, layout=path, parallel=True)))


def test_verify_deep_by_two_processes_reports_what_one_does(ckpts: dict[str, Path]) -> None:
    sick = ckpts["sick"]
    owners = _owners(sick)
    assert owners[("u0.w", "exp_avg")] == 0 and owners[("u3.b", "exp_avg_sq")] == 1, f"each finds one: {owners}"
    one = report_json(verify(sick, deep=True, layout=sick))
    findings: Any = one["findings"]
    assert [f["param"] for f in findings] == ["u0.w", "u3.b"], findings
    (r0, made0), (r1, made1) = run_ranks(_deep_in_ranks, 2, str(sick), deadline_s=120)
    assert r0 == r1 == one, (r0, r1, one)
    assert not set(made0) & set(made1), "no state tensor read by both processes"
    assert sorted(made0 + made1) == sorted(owners), "every state tensor read once, by its owner"
    assert {owners[m] for m in made0} == {0} and {owners[m] for m in made1} == {1}, (made0, made1)


def _diff_in_ranks(rank: int, world_size: int, a: str, b: str) -> tuple[Any, list[tuple[str, str]]]:  # noqa: ARG001
    def run() -> Any:
        try:
            return diff(a, b, parallel=True).to_json()
        except ValueError as exc:
            return f"ValueError: {exc}"

    return _made(run)


@pytest.mark.parametrize(("a", "b"), [("src", "other"), ("other", "named.safetensors")])
def test_diff_by_two_processes_reports_what_one_does(ckpts: dict[str, Path], a: str, b: str) -> None:
    one = diff(ckpts[a], ckpts[b]).to_json()
    assert not one["equal"], "u2.w differs"
    (r0, made0), (r1, made1) = run_ranks(_diff_in_ranks, 2, str(ckpts[a]), str(ckpts[b]), deadline_s=120)
    assert r0 == r1 == one, (r0, r1)
    tensors = {(row["param"], row["key"]) for row in one["rows"] if not row["scalar"]}  # type: ignore[index]
    assert made0 and made1, "both processes read"
    assert sorted(made0 + made1) == sorted(m for k in tensors for m in (k, k)), "each pair of tensors made once"
    assert not set(made0) & set(made1), "no state tensor read by both processes"


def test_diff_of_a_full_dict_runs_on_process_0(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A full dict is loaded whole: process 0 compares, process 1 reads nothing and returns the same report."""
    full = tmp_path / "full.pt"
    torch.save(fsdp_optim.consolidate(ckpts["src"]), full)
    one = diff(ckpts["other"], full).to_json()
    (r0, made0), (r1, made1) = run_ranks(_diff_in_ranks, 2, str(ckpts["other"]), str(full), deadline_s=120)
    assert r0 == r1 == one and made0 and not made1, (made0, made1)


def _whole_in_ranks(rank: int, world_size: int, a: str, b: str) -> tuple[Any, Any]:  # noqa: ARG001
    return report_json(verify(a, deep=True, parallel=True)), diff(a, b, parallel=True).to_json()


def test_a_whole_checkpoint_by_two_processes(tmp_path: Path) -> None:
    """Weights (``@param``), per-rank buffers and ``extra`` (the side files, read by one process): ``verify --deep``
    and ``diff`` against its reshard to 3 are one process's reports."""
    from test_whole_state import _save

    whole = tmp_path / "step3"
    run_ranks(_save, 2, str(whole), True)
    fsdp_optim.reshard(whole, 3, tmp_path / "w3", buffers="rank0")
    one = report_json(verify(whole, deep=True)), diff(whole, tmp_path / "w3").to_json()
    rows: Any = one[1]["rows"]
    assert any(r["key"] == "@param" for r in rows) and any("@buffer" in r["key"] for r in rows), "weights, buffers"
    both = run_ranks(_whole_in_ranks, 2, str(whole), str(tmp_path / "w3"), deadline_s=120)
    assert both == [one, one], (both, one)


def _flipped(src: Path, dst: Path, rank: int, at: int) -> Path:
    """A copy of ``src`` with one byte of rank file ``rank``'s data flipped at ``at`` (negative: from its end)."""
    import shutil

    shutil.copytree(src, dst)
    victim = sorted(dst.glob(f"optim-*rank{rank:05d}*"))[0]
    raw = bytearray(victim.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + at if at >= 0 else at] ^= 0xFF
    victim.write_bytes(bytes(raw))
    return dst


def test_a_damaged_chunk_found_by_either_process_fails_both(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A byte of u0.w's exp_avg (process 0's share), then of u3.b's exp_avg_sq (process 1's): both processes fail
    with one process's message, the finder's plain, the other's naming the rank that raised it."""
    finders = []
    for case, (rank, at) in enumerate([(0, 100), (1, -3)]):
        damaged = _flipped(ckpts["src"], tmp_path / f"damaged{case}", rank, at)
        with pytest.raises(ValueError) as one:
            diff(ckpts["src"], damaged)
        r0, r1 = (r for r, _ in run_ranks(_diff_in_ranks, 2, str(ckpts["src"]), str(damaged), deadline_s=120))
        plain = f"ValueError: {one.value}"
        assert r0.startswith(plain) and r1.startswith(plain), (r0, r1, plain)
        finders += [r for r, text in enumerate((r0, r1)) if text == plain]
    assert finders == [0, 1], f"process 0 found the first byte, process 1 the second: {finders}"


# A process of the CLI that is killed when it makes its first state tensor.
_KILLED = """
import os, signal, sys
from fsdp_optim.offline.per_param import PerParameter
def killed(self, name, key):
    os.kill(os.getpid(), signal.SIGKILL)
PerParameter.tensor = killed
from fsdp_optim.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _pair(argv: list[str], killed: int | None = None) -> list[tuple[int, str, str, float]]:
    """``fsdp-optim argv`` as 2 processes of ``torchrun`` (its environment): ``(code, stdout, stderr, seconds)``."""
    port, start = free_port(), time.monotonic()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # fmt: skip
        head = ["-c", _KILLED] if rank == killed else ["-m", "fsdp_optim"]
        procs.append(subprocess.Popen([sys.executable, *head, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, 150 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr, time.monotonic() - start))
    return out


@pytest.mark.parametrize("verb", [["verify", "--deep"], ["diff", "--json"]])
def test_cli_prints_once_what_one_process_prints(
    ckpts: dict[str, Path], verb: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*verb, str(ckpts["sick"]), *([str(ckpts["other"])] if verb[0] == "diff" else [])]
    code = main(argv)
    one = capsys.readouterr()
    assert code == 1 and one.out, one.err  # findings; differences
    (c0, out0, err0, _), (c1, out1, err1, _) = _pair(argv)
    assert (c0, c1) == (1, 1) and out0 == one.out and out1 == "", (err0, err1)
    assert err0.splitlines()[-1:] == one.err.splitlines()[-1:], (err0, one.err)
    if verb[0] == "diff":
        assert json.loads(out0)["equal"] is False, out0


def test_cli_convert_runs_on_process_0(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """``convert`` has no split (docs/cli.md says why): process 0 writes the bytes one process writes."""
    main(["convert", str(ckpts["src"]), "--to", "safetensors", "-o", str(tmp_path / "one.safetensors")])
    two = tmp_path / "two.safetensors"
    (c0, out0, err0, _), (c1, out1, err1, _) = _pair(["convert", str(ckpts["src"]), "--to", "safetensors", "-o", str(two)])
    assert (c0, c1) == (0, 0) and out0.startswith(f"wrote {two}") and out1 == "", (err0, err1)
    assert two.read_bytes() == (tmp_path / "one.safetensors").read_bytes(), "what one process writes"


@pytest.mark.parametrize(
    ("verb", "victim"),
    [(["verify", "--deep"], 1), (["diff"], 1), pytest.param(["diff"], 0, marks=pytest.mark.slow)],
)
def test_a_killed_process_fails_the_other_fast(ckpts: dict[str, Path], verb: list[str], victim: int) -> None:
    argv = [*verb, str(ckpts["src"]), *([str(ckpts["other"])] if verb[0] == "diff" else [])]
    results = _pair(argv, killed=victim)
    code, out, err, seconds = results[1 - victim]
    assert results[victim][0] == -signal.SIGKILL, results[victim]
    trouble = 2 if verb[0] == "diff" else 1  # diff: diff(1)'s codes, 1 is "different"
    assert code == trouble and "fsdp-optim: error:" in err and out == "", (code, out, err)
    assert "lost contact with another process" in err, err
    assert seconds < 60, f"the other process took {seconds:.0f} s to fail"
