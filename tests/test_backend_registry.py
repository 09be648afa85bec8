"""A backend of one's own, reached by URL: :func:`fsdp_optim.register_backend` and the interface's public names.

The backend is the suite's own (``tests/_flat_store.py``: an :class:`fsdp_optim.ObjectBackend` of eight methods),
registered for a scheme in every rank of a real job; the job saves, verifies and loads through its URL, and the
fsspec backend is never imported by a job that only ever names local paths or a registered scheme.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _models as M
import pytest
from _checks import assert_identical
from _dist import run_ranks
from _flat_store import open_flat

import fsdp_optim

ROOT = Path(__file__).resolve().parent.parent


def _save_and_load_by_url(rank: int, world_size: int, url: str) -> dict[str, Any]:
    import sys as _sys

    fsdp_optim.register_backend("flat", open_flat)
    root = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(root))
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    fsdp_optim.save_checkpoint(root, optim, url, extra={"step": 1})
    fresh = M.wrap(M.make_net(seed=7), "deep")
    fresh_optim = M.OPTIMIZERS["adam"](M.fsdp_param_groups(fresh))
    extra = fsdp_optim.load_checkpoint(fresh, fresh_optim, url)
    assert_identical(fresh_optim.state_dict(), optim.state_dict(), "optimizer through the registered backend")
    return {"extra": extra, "verified": fsdp_optim.verify(url).ok, "fsspec": "fsspec" in _sys.modules,
            "storage": "fsdp_optim.disk.storage" in _sys.modules}  # fmt: skip


def test_a_registered_scheme_saves_verifies_and_loads_through_its_backend(tmp_path: Path) -> None:
    url = f"flat://{tmp_path / 'objects'}/ckpt-run"
    outs = run_ranks(_save_and_load_by_url, 2, url)
    assert all(o["extra"] == {"step": 1} and o["verified"] for o in outs), outs
    assert not any(o["storage"] or o["fsspec"] for o in outs), f"a registered backend loaded the fsspec one: {outs}"
    objects = sorted(p.name for p in (tmp_path / "objects").iterdir() if not p.name.startswith("."))
    assert len(objects) == 5, objects  # manifest, 2 rank files, 2 side files: all in the backend's flat directory


def test_a_local_save_imports_no_fsspec_code(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        import fsdp_optim
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        model = fsdp_optim.FullyShardedDataParallel(torch.nn.Linear(4, 2))
        optim = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 4)).sum().backward(); optim.step()
        fsdp_optim.save_checkpoint(model, optim, "{tmp_path}/ckpt")
        fsdp_optim.load_checkpoint(model, optim, "{tmp_path}/ckpt")
        assert fsdp_optim.verify("{tmp_path}/ckpt").ok
        dist.destroy_process_group()
        print(sorted(m for m in sys.modules if m.startswith(("fsspec", "s3fs", "fsdp_optim.disk.storage"))))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("scheme", ["file", "", "1x", "my store"])
def test_a_scheme_that_is_not_one_is_refused(scheme: str) -> None:
    with pytest.raises(ValueError, match="scheme"):
        fsdp_optim.register_backend(scheme, open_flat)


def test_the_interface_and_its_errors_are_public() -> None:
    assert issubclass(fsdp_optim.ObjectBackend, fsdp_optim.Location)
    assert issubclass(fsdp_optim.ConcurrentCommitError, FileExistsError)
    assert issubclass(fsdp_optim.StoreUnavailable, OSError) and issubclass(fsdp_optim.CommitOutcomeUnknown, OSError)
    abstract = sorted(fsdp_optim.ObjectBackend.__abstractmethods__)
    assert abstract == sorted(["__str__", "child", "listing", "prefixes", "read_into", "write", "commit", "delete"])


def _cli(args: list[str], env: dict[str, str], path: list[Path]) -> subprocess.CompletedProcess[str]:
    """``python -m fsdp_optim ARGS`` in a fresh process: nothing of this one's registrations reaches it."""
    import os

    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(map(str, [*path, ROOT, ROOT / "tests"]))}
    return subprocess.run([sys.executable, "-m", "fsdp_optim", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def flat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"flat://{tmp_path_factory.mktemp('flat') / 'objects'}/ckpt-run"
    run_ranks(_save_and_load_by_url, 2, url)
    return url


def test_a_module_named_by_the_environment_brings_its_backend_to_the_command_line(
    tmp_path: Path, flat_checkpoint: str
) -> None:
    (tmp_path / "my_backend.py").write_text(
        "import fsdp_optim\nfrom _flat_store import open_flat\nfsdp_optim.register_backend('flat', open_flat)\n"
    )
    for verb in ("inspect", "verify"):
        done = _cli([verb, flat_checkpoint], {"FSDP_OPTIM_BACKENDS": "my_backend"}, [tmp_path])
        assert done.returncode == 0, f"{verb}: {done.stderr[-2000:]}"
        assert "ckpt-run" in done.stdout, done.stdout
    done = _cli(["inspect", flat_checkpoint], {"FSDP_OPTIM_BACKENDS": "no_such_module"}, [tmp_path])
    assert done.returncode == 1 and "FSDP_OPTIM_BACKENDS names the module 'no_such_module'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_entry_point_brings_its_backend_to_the_command_line(tmp_path: Path, flat_checkpoint: str) -> None:
    info = tmp_path / "flat_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flat-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[fsdp_optim.backends]\nflat = _flat_store:open_flat\n")
    done = _cli(["inspect", flat_checkpoint], {"FSDP_OPTIM_BACKENDS": ""}, [tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ckpt-run" in done.stdout, done.stdout


def test_an_unknown_scheme_names_the_ways_to_add_a_backend(tmp_path: Path) -> None:
    done = _cli(["inspect", "nosuchscheme://bucket/ckpt"], {"FSDP_OPTIM_BACKENDS": ""}, [tmp_path])
    assert done.returncode == 1, done.stderr
    for said in ("nosuchscheme", "register_backend", "FSDP_OPTIM_BACKENDS", "fsdp_optim.backends"):
        assert said in done.stderr, f"{said!r} not in {done.stderr}"
