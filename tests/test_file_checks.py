"""What comes from a file is checked by real errors, never by ``assert``.

``python -O`` strips asserts, so an assert that guards a file's content (a read's length, shards that tile a
tensor, rows of a recut) is no check at all there. The modules that read files (everything in ``disk/`` and
``offline/``, and ``formats/`` but the writers) hold no ``assert``; the few asserts left in ``formats/`` are
invariants of our own writers and plans, listed below with why. And refusals of damaged files (a flipped
byte of a sharded checkpoint and of a named safetensors file) give the same clear error under ``-O``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

import fsdp_optim
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_optim"
# Asserts that check our own code, not a file: module -> how many, and why.
INVARIANTS = {
    "formats/dcp.py": 3,  # DCP's planner hands our writer the items our planner made
    "formats/named_safetensors/writer.py": 1,  # the header we built
    "formats/fairseq/shards.py": 1,  # a weights plan we restricted to one entry
    "formats/sharded/steps.py": 1,  # remove_step is called on a directory our own survey found to be ours
    # A whole checkpoint's training section, which weights_source() and is_whole() checked before:
    "offline/whole.py": 2,
    # Under torchrun: what the processes agreed on, before anything is read from it
    "offline/parallel/entry.py": 1,  # a path that splits() called sharded opens as a sharded checkpoint
    "offline/parallel/reshard.py": 2,  # the plan agreed on, every rank written once
    # The one save driver's rename: a local directory's writer on the process that began the save
    "disk/local_directory.py": 2,
    "disk/one_file.py": 2,  # a one-file writer staged and committed by the process that began it
    # A rank file's reader: called in the order open, read (its own state), and only on the format it opened
    "formats/sharded/rank_file.py": 3,
    "formats/sharded/reader.py": 1,
}


def test_modules_that_read_files_check_them_with_errors_not_asserts() -> None:
    found = {}
    for folder in ("disk", "formats", "offline"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            count = sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(path.read_text())))
            if count:
                found[str(path.relative_to(PACKAGE))] = count
    assert found == INVARIANTS, (
        f"asserts in modules that read files: {found}, expected only {INVARIANTS}; a check on what came "
        "from a file must raise ValueError (python -O strips asserts)"
    )


def _files(tmp_path: Path) -> tuple[Path, Path]:
    """A small sharded checkpoint (2 ranks, made offline) and a named safetensors file of the same state."""
    g = torch.Generator().manual_seed(0)
    entries = {0: (40, 30), 1: (7,)}
    state = {i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(s, generator=g),
                 "exp_avg_sq": torch.rand(s, generator=g)} for i, s in entries.items()}  # fmt: skip
    full = {
        "state": state,
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0, "params": [0, 1]}],
        "param_names": {0: "w", 1: "b"},
        "fsdp_optim": {"version": 1, "optimizer": "Adam", "world_size": 1, "scalar_keys": ["step"]},
    }
    specs = (ParamSpec("w", (40, 30), 0), ParamSpec("b", (7,), 1200))
    layout = ModelLayout((FlatParamLayout("", specs, 2, 0, torch.float32, False),), ("w", "b"), 2, 0)
    fsdp_optim.reshard(full, 2, tmp_path / "ckpt", layout=layout)
    fsdp_optim.to_safetensors(full, tmp_path / "optim.safetensors")
    return tmp_path / "ckpt", tmp_path / "optim.safetensors"


def _flip_middle_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start + (len(raw) - start) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_damaged_files_are_refused_the_same_under_python_dash_O(tmp_path) -> None:
    ckpt, named = _files(tmp_path)
    _flip_middle_data_byte(sorted(ckpt.glob("*rank00001*"))[0])
    _flip_middle_data_byte(named)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for argv in (["consolidate", str(ckpt), "-o", str(tmp_path / "a.pt")],
                 ["consolidate", str(named), "-o", str(tmp_path / "b.pt")],
                 ["verify", str(named)]):  # fmt: skip
        done = subprocess.run([sys.executable, "-O", "-m", "fsdp_optim", *argv], capture_output=True, text=True,
                              env=env, timeout=300)  # fmt: skip
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        assert done.returncode == 1 and last.startswith("fsdp-optim: error: ") and "checksum" in last, (argv, done)
        assert "Traceback" not in done.stderr, (argv, done.stderr)
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()
