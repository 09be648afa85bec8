"""What installing and importing fsdp_optim costs: nothing heavy until it is needed.

Each check runs in a fresh interpreter (this test process has long since imported everything).

- ``import fsdp_optim`` and ``import fsdp_optim.cli`` load neither torch nor fairscale (the package's names
  are resolved on first use, PEP 562), so ``fsdp-optim --help`` costs no more than starting Python.
- The offline paths (consolidate, reshard, inspect through the CLI) load torch, but neither fairscale, nor
  our collectives module, nor any ``torch.distributed`` module beyond those ``import torch`` loads by itself:
  torch 2.13 imports ``torch.distributed.distributed_c10d`` from ``torch.utils.data`` on ``import torch``, so
  that module cannot be the sentinel; we compare against a bare ``import torch`` instead.
- ``__all__`` and the lazy names agree, and ``setup.py`` declares ranges while the exact pins live in
  ``constraints.txt``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _models as M
import pytest
import torch
from _dist import run_ranks

import fsdp_optim

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("fairscale", "fsdp_optim.job.transport", "fsdp_optim.job.fsdp", "fsdp_optim.job.api", "fsdp_optim.job.sharded")


def _modules_after(code: str) -> set[str]:
    """The ``sys.modules`` keys after running ``code`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _loaded(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if m in prefixes or m.startswith(tuple(f"{p}." for p in prefixes)))


def test_import_and_cli_load_neither_torch_nor_fairscale() -> None:
    modules = _modules_after("import fsdp_optim\nimport fsdp_optim.cli\nfsdp_optim.cli.build_parser().format_help()")
    assert not _loaded(modules, ("torch", *HEAVY)), _loaded(modules, ("torch", *HEAVY))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packaging")
    run_ranks(_save, 2, str(out))
    return out


def _save(rank: int, world_size: int, out: str) -> None:
    root = M.wrap(M.make_net(), "shallow")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_sharded_optim_state(root, optim, os.path.join(out, "ckpt"))
    full = fsdp_optim.gather_full_optim_state_dict(root, optim)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))


def test_offline_paths_load_no_fairscale_and_no_collectives(checkpoint: Path) -> None:
    baseline = _modules_after("import torch")
    code = "\n".join(
        [
            "import fsdp_optim",
            "from fsdp_optim.cli import main",
            f"full = fsdp_optim.consolidate({str(checkpoint / 'ckpt')!r})",
            f"fsdp_optim.reshard({str(checkpoint / 'ckpt')!r}, 3, {str(checkpoint / 'ws3')!r})",
            f"fsdp_optim.reshard(full, 1, {str(checkpoint / 'ws1')!r}, layout={str(checkpoint / 'ckpt')!r})",
            f"assert main(['inspect', {str(checkpoint / 'ckpt')!r}, '--units']) == 0",
            f"assert main(['inspect', {str(checkpoint / 'full.pt')!r}]) == 0",
            f"assert main(['consolidate', {str(checkpoint / 'ws3')!r}, '-o', {str(checkpoint / 'back.pt')!r}]) == 0",
            "fsdp_optim.from_fairscale, fsdp_optim.to_named, fsdp_optim.FORMAT_VERSION",
        ]
    )
    modules = _modules_after(code)
    assert not _loaded(modules, HEAVY), _loaded(modules, HEAVY)
    extra = sorted(m for m in modules - baseline if m.startswith("torch.distributed"))
    assert not extra, f"offline work imported torch.distributed modules that `import torch` does not: {extra}"
    assert (checkpoint / "back.pt").is_file()


def test_lazy_names_match_all() -> None:
    assert sorted(fsdp_optim.__all__) == sorted(set(fsdp_optim.__all__))
    for name in fsdp_optim.__all__:
        assert getattr(fsdp_optim, name) is not None, name
    assert set(fsdp_optim.__all__) <= set(dir(fsdp_optim))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        fsdp_optim.nothing_here  # noqa: B018


def test_install_requires_are_ranges_and_pins_live_in_constraints() -> None:
    setup = (ROOT / "setup.py").read_text()
    assert "torch==" not in setup and "fairscale==" not in setup, "exact pins belong in constraints.txt"
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert pins["torch"] == "2.13.0" and pins["fairscale"] == "0.4.13", pins
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index('"torch==2.13.0"') < ci.index("-c constraints.txt"), "CI installs the CPU torch wheel first"


def test_readme_shows_the_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python -m pip")]
    assert len(commands) == 2, commands
    assert "\n".join(commands) in readme, "README's test command must be exactly what .ci/run runs"


def test_readme_names_the_cpu_wheel_and_clip_grad_norm_works_on_cpu() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "download.pytorch.org/whl/cpu" in readme  # the CPU wheel on a machine without CUDA
    assert "not shimmed on CPU" not in readme  # the host switch does shim clip_grad_norm_
