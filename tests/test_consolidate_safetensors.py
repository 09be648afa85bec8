"""``fsdp-optim consolidate SRC -o FILE.safetensors`` (``fsdp_optim/offline/onefile.py``): one safetensors file of a
whole or optimizer-only sharded checkpoint, its header laid out before any tensor is written, each tensor written at
its offset; the same bytes whatever the number of processes; every tensor what ``consolidate`` to a ``.pt`` gives;
a failure anywhere commits nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import free_port, run_ranks
from safetensors import safe_open
from test_recut_blocks import _full, _layout

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.formats.sharded.side_file import decode_extra
from fsdp_optim.offline.verify import verify

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def optim_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An optimizer-only checkpoint of six units (two dtypes, one unit not sharded, one empty) at world size 2."""
    src = tmp_path_factory.mktemp("onefile") / "optim"
    fsdp_optim.reshard(_full(_layout(4)), 2, src, layout=_layout(4))
    return src


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole checkpoint (weights, a tied name, a buffer, Adam, an extra with an RNG tensor) of 2 fairscale ranks."""
    from test_whole_state import _save

    out = tmp_path_factory.mktemp("onefile") / "whole"
    run_ranks(_save, 2, str(out), False)
    return out


def _cli(*argv: Any) -> int:
    return main([str(a) for a in argv])


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["fsdp_optim"])  # noqa: SIM118


def _equal_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"], "the param groups"
    assert sorted(a["state"]) == sorted(b["state"]), "the params with state"
    for p, entries in b["state"].items():
        assert list(a["state"][p]) == list(entries), f"state keys of {p}"
        for k, v in entries.items():
            same = torch.equal(a["state"][p][k], v) if torch.is_tensor(v) else a["state"][p][k] == v
            assert same, f"state {k} of {p}"


def test_whole_checkpoint_is_one_file_equal_to_the_pt(whole: Path, tmp_path: Path) -> None:
    """Every model tensor (weights, tied names, buffers), ``extra`` and the optimizer's full dict are what the .pt
    holds; ``load_full_state`` and ``verify`` read the file."""
    st, pt = tmp_path / "model.safetensors", tmp_path / "model.pt"
    assert _cli("consolidate", whole, "-o", st) == 0 and _cli("consolidate", whole, "-o", pt) == 0
    ref = torch.load(pt, weights_only=False)
    tensors, doc = _tensors(st)
    for name, value in ref["model"].items():
        assert torch.equal(tensors[name], value) and tensors[name].dtype == value.dtype, name
    assert doc["whole"]["model"] == list(ref["model"]), "the state_dict's names, in its order"
    extra = decode_extra(doc["whole"]["extra"], {k: tensors[k] for k in doc["whole"]["extra_tensors"]}, "extra")
    assert extra.keys() == ref["extra"].keys() and torch.equal(extra["rng"], ref["extra"]["rng"]), extra
    assert extra["scheduler"] == ref["extra"]["scheduler"], "tuples and inf kept exactly"
    assert doc["optimizer"] == "Adam" and doc["version"] == 3, doc["version"]
    for p, entries in ref["optimizer"]["state"].items():
        name = ref["optimizer"]["param_names"][p] if "param_names" in ref["optimizer"] else None
        for k, v in entries.items():
            if name is not None and torch.is_tensor(v):
                assert torch.equal(tensors[f"{name}/{k}"], v), f"{name}/{k}"
    _equal_state(fsdp_optim.load_full_state(st), ref["optimizer"])
    assert verify(st).ok, "the file verifies (every checksum, model tensors included)"


def test_optimizer_only_checkpoint(optim_only: Path, tmp_path: Path) -> None:
    st = tmp_path / "optim.safetensors"
    assert _cli("consolidate", optim_only, "-o", st) == 0
    _equal_state(fsdp_optim.load_full_state(st), fsdp_optim.consolidate(optim_only))
    tensors, doc = _tensors(st)
    assert "whole" not in doc and doc["version"] == 2, "an optimizer-only file is a version-2 named file"
    assert all("/" in name for name in tensors), "optimizer state only"
    assert verify(st).ok


def test_header_first_layout_is_stable(whole: Path, tmp_path: Path) -> None:
    """Two runs give the same bytes; the header's tensors are in file order (model, extra, optimizer) and packed."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert _cli("consolidate", whole, "-o", a) == 0 and _cli("consolidate", whole, "-o", b) == 0
    assert a.read_bytes() == b.read_bytes(), "two one-process runs differ"
    raw = a.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    offsets = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    assert offsets == sorted(offsets) and offsets[0][0] == 0 and offsets[-1][1] == len(raw) - 8 - n, "packed"


def test_bad_output_is_refused(whole: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken.safetensors"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert _cli("consolidate", whole, "-o", taken, "--overwrite") == 1
    assert f"-o {taken}: an existing directory" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"], "the directory was left as it was"
    existing = tmp_path / "x.safetensors"
    existing.write_bytes(b"old")
    assert _cli("consolidate", whole, "-o", existing) == 1 and existing.read_bytes() == b"old", "no --overwrite"
    assert "exists already" in capsys.readouterr().err


def test_a_failure_mid_write_leaves_nothing(whole: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor that cannot be made (the fourth of the file) fails the write: no file, no temporary file left."""
    from dataclasses import replace

    import fsdp_optim.offline.onefile as onefile

    real = onefile.write_tensors

    def failing(path: Any, layout: Any, which: Any, *, after: Any) -> Any:
        broken = list(layout.tensors)
        broken[3] = replace(broken[3], make=_disk_full)
        return real(path, replace(layout, tensors=tuple(broken)), which, after=after)

    monkeypatch.setattr(onefile, "write_tensors", failing)
    out = tmp_path / "model.safetensors"
    assert _cli("consolidate", whole, "-o", out) == 1
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


def _disk_full() -> torch.Tensor:
    raise OSError("disk full (injected)")


# A process of the CLI under a torchrun-like environment; "kill" kills itself (SIGKILL) once it has written its
# first tensor of the file.
_PROCESS = """
import os, signal, sys
import fsdp_optim.offline.onefile as P
real = P.write_tensors
def killed(path, layout, which, *, after):
    def then(nbytes):
        after(nbytes)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, layout, which, after=then)
if sys.argv[1] == "kill":
    P.write_tensors = killed
from fsdp_optim.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _pair(argv: list[Any], how: dict[int, str]) -> list[tuple[int, str, str]]:
    """Processes 0 and 1 of 2, as torchrun starts them, running ``fsdp-optim argv``: (exit code, stdout, stderr)."""
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, how.get(r, "-"), *map(str, argv)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("source", ["whole", "optim_only"])
def test_two_processes_write_the_bytes_one_writes(source: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src = request.getfixturevalue(source)
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    assert _cli("consolidate", src, "-o", one) == 0
    results = _pair(["consolidate", src, "-o", two], {})
    assert [code for code, _, _ in results] == [0, 0], results
    assert results[0][1].startswith(f"wrote {two}: safetensors, one file") and results[1][1] == "", results
    assert one.read_bytes() == two.read_bytes(), "2 processes wrote other bytes than 1"
    assert sorted(os.listdir(tmp_path)) == ["one.safetensors", "two.safetensors"], "nothing else left"


def test_a_killed_process_commits_nothing(whole: Path, tmp_path: Path) -> None:
    """Process 1 killed after its first tensor: process 0 fails (exit 1) within the team's timeout, removes its
    temporary file, commits nothing; a rerun writes the file."""
    out = tmp_path / "model.safetensors"
    results = _pair(["consolidate", whole, "-o", out], {1: "kill"})
    assert results[1][0] == -9 and results[0][0] == 1, results
    assert "fsdp-optim: error:" in results[0][2], results[0][2]
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)
    assert [code for code, _, _ in _pair(["consolidate", whole, "-o", out], {})] == [0, 0]
    assert verify(out).ok


def test_two_processes_refuse_a_directory_and_an_existing_file(whole: Path, tmp_path: Path) -> None:
    """A directory: refused by every process while planning; a file without --overwrite: by process 0's output
    (its lock), which every process then raises; both left as they were. Process 0 alone says why (one line under
    torchrun), every process exits with its code."""
    taken = tmp_path / "taken.safetensors"
    taken.mkdir()
    results = _pair(["consolidate", whole, "-o", taken], {})
    assert [code for code, _, _ in results] == [1, 1], results
    assert "an existing directory" in results[0][2] and "an existing directory" not in results[1][2], results
    assert os.listdir(taken) == [], "left as it was"
    existing = tmp_path / "x.safetensors"
    existing.write_bytes(b"old")
    results = _pair(["consolidate", whole, "-o", existing], {})
    assert [code for code, _, _ in results] == [1, 1] and "exists already" in results[0][2], results
    assert "exists already" not in results[1][2], results
    assert existing.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["taken.safetensors", "x.safetensors"]


def test_torchrun_two_processes(whole: Path, tmp_path: Path) -> None:
    """The real launcher: the file one process writes, printed once."""
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    assert _cli("consolidate", whole, "-o", one) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "fsdp_optim", "consolidate", str(whole), "-o", str(two)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1 and done.stdout.startswith(f"wrote {two}"), done.stdout
    assert one.read_bytes() == two.read_bytes(), "torchrun's 2 processes wrote other bytes than 1"
