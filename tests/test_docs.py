"""The documentation site builds with no warning (``mkdocs build --strict``, as the docs extra installs it; CI
installs it through the test extra, so this is skipped only where mkdocs is missing), and its API reference
renders every public name of ``fsdp_optim``."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import run_ranks

import fsdp_optim

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docs.blocks import Block, all_blocks  # noqa: E402 - the repository root is not on the path under pytest
from docs.regenerate import (  # noqa: E402
    FIXTURE_WORLD_SIZE,
    HINT,
    commands,
    console_blocks,
    normalise,
    page_blocks,
    rendered,
    shown,
)

blocks_of = all_blocks

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason='needs the docs extra: pip install -e ".[docs]"')
def test_mkdocs_build_strict_renders_every_public_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(fsdp_optim\.[\w.]+)"', api))
    missing = [name for name in fsdp_optim.__all__ if f"fsdp_optim.{name}" not in anchors]
    assert not missing, f"public names the API reference does not render: {missing}"
    assert ":func:`" not in api and ":mod:`" not in api, "a Sphinx role was printed as it is"
    internal = re.findall(r"^::: (?!fsdp_optim(?:\.fairseq)?(?:\.\w+)?\s)(\S+)", (ROOT / "docs" / "api.md").read_text() + "\n", re.M)
    assert not internal, f"docs/api.md documents these at internal paths, not as fsdp_optim.X: {internal}"


# ---- Every ```python block of README.md and docs/*.md runs (docs/blocks.py says how a marker changes that).
#
# Blocks run in document order, page by page, each page in a directory of its own that its blocks share (a later
# block reads what an earlier one saved), each block in a fresh namespace on every rank of a gloo job: 2 ranks, or
# the world size its marker names (those run after the 2-rank blocks). A block may use the names PRELUDE gives
# (a small model class, a wrapped model and its optimizer after a step, a training function, ...), which stand for
# the user's own. `init_process_group` is a no-op there: the job has its group already.
#
# One job runs them all, and makes the checkpoints the console blocks' commands read (docs/regenerate.py): its
# processes start once (what costs most), then form one process group per world size in turn (2 first, then the
# others in increasing order; the ranks beyond a world size wait for the next group).

PRELUDE = """
import torch
import fsdp_optim

class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x):
        return self.head(torch.relu(self.block(torch.relu(self.embed(x)))))

def wrapped():
    net = MyModel()
    net.block = fsdp_optim.FullyShardedDataParallel(net.block)
    return fsdp_optim.FullyShardedDataParallel(net)

def train(model, optim, batch=None):
    torch.manual_seed(torch.distributed.get_rank())
    model(torch.randn(4, 8) if batch is None else batch).square().mean().backward()
    optim.step()
    optim.zero_grad()

train_step = train
model = wrapped()
optim = torch.optim.Adam(model.parameters(), lr=1e-3)
train(model, optim)
step = 1000
scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=10)
loader = [torch.randn(4, 8) for _ in range(3)]
"""

FIXTURES = "fixtures of the console blocks"  # the key of make_fixtures' failure in the job's outcomes


def _run_blocks(rank: int, world_size: int, root: str, blocks: list[tuple[str, str, str]]) -> dict[str, str]:
    """Run each (name, page directory, source) in order on this rank; {name: traceback} of those that raised."""
    import os
    import traceback

    import torch.distributed as dist

    failed: dict[str, str] = {}
    original = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    here = os.getcwd()
    try:
        for name, page_dir, source in blocks:
            os.makedirs(os.path.join(root, page_dir), exist_ok=True)
            os.chdir(os.path.join(root, page_dir))
            namespace: dict[str, object] = {"__name__": "__docs__"}
            try:
                exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
                exec(compile(source, name, "exec"), namespace)
            except Exception:
                failed[name] = traceback.format_exc()
            dist.barrier()
    finally:
        dist.init_process_group = original
        os.chdir(here)
    return failed


def _docs_job(rank: int, world_size: int, root: str, phases: list[tuple[int, list[tuple[str, str, str]]]], fixtures: str) -> dict[str, str]:
    """On each of ``world_size`` processes: for each (world size W, blocks) in turn, the first W processes form a
    gloo group of W ranks and run the blocks; the 2-rank group then makes the console blocks' fixtures."""
    import datetime
    import traceback

    import torch.distributed as dist
    from fairscale.internal.parallel import get_process_group_cached

    from docs.regenerate import FIXTURE_WORLD_SIZE, make_fixtures

    dist.destroy_process_group()  # run_ranks's group of every process: each phase forms its own
    failed: dict[str, str] = {}
    for size, blocks in phases:
        if rank >= size:
            continue
        store = f"file://{root}/.group-of-{size}"
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=300))
        try:
            failed.update(_run_blocks(rank, size, root, blocks))
            if size == FIXTURE_WORLD_SIZE:
                try:
                    make_fixtures(rank, size, fixtures)
                except Exception:
                    failed[FIXTURES] = traceback.format_exc()
        finally:
            vars(get_process_group_cached).pop("_global_group_cache", None)  # fairscale's groups of this phase
            dist.destroy_process_group()
    return failed


PYTHON_BLOCKS = blocks_of("python")


@pytest.fixture(scope="module")
def docs_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """The one job: {block name (or FIXTURES): traceback} of what failed on any rank, and the fixtures' directory."""
    root = tmp_path_factory.mktemp("docs-python")
    fixtures = tmp_path_factory.mktemp("docs-console") / "fixtures"
    fixtures.mkdir()
    sizes = sorted({b.world_size for b in PYTHON_BLOCKS} | {FIXTURE_WORLD_SIZE}, key=lambda w: (w != 2, w))
    phases = [
        (size, [(b.name, b.page.replace("/", "_"), b.body) for b in PYTHON_BLOCKS if b.world_size == size and b.not_run is None])
        for size in sizes
    ]
    failed: dict[str, str] = {}
    for per_rank in run_ranks(_docs_job, max(sizes), str(root), phases, str(fixtures), deadline_s=600):
        for name, error in per_rank.items():
            failed.setdefault(name, error)
    return failed, fixtures


@pytest.fixture(scope="module")
def python_outcomes(docs_job: tuple[dict[str, str], Path]) -> dict[str, str]:
    return docs_job[0]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.name for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, python_outcomes: dict[str, str]) -> None:
    if block.not_run is not None:
        assert block.not_run.strip(), f"{block.name}: a 'not run' marker must say why"
        pytest.skip(f"not run: {block.not_run}")
    assert block.name not in python_outcomes, python_outcomes[block.name]


def test_few_blocks_are_not_run() -> None:
    not_run = [b.name for b in PYTHON_BLOCKS if b.not_run is not None]
    # 4 need a fairseq shard set, 1 an S3 server: each names the test that runs the same calls.
    assert len(not_run) <= 5 + 1, f"keep 'not run' markers few: {not_run}"


# ---- Every ```console block showing `$ fsdp-optim ...` shows what the commands print now (docs/regenerate.py runs
# them on the job's fixtures, normalised the same way, and rewrites the blocks: `python -m docs.regenerate`).

CONSOLE_BLOCKS = console_blocks()


@pytest.fixture(scope="module")
def console_now(docs_job: tuple[dict[str, str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """{block name: its body as the commands print it now}, every command run once."""
    failed, fixtures = docs_job
    assert FIXTURES not in failed, failed[FIXTURES]
    workdir = tmp_path_factory.mktemp("docs-console-pages")
    return {b.name: rendered(b, outputs) for _, b, outputs in page_blocks(fixtures, workdir)}


def test_console_commands_parse_as_written() -> None:
    body = "$ fsdp-optim inspect ckpt/a \\\n    --units   # a comment\nout 1\nout 2\n$ fsdp-optim list 'my ckpt'\n"
    block = Block("docs/x.md", 3, "console", body, 3, 9)
    found = commands(block)
    assert [c.argv for c in found] == [["inspect", "ckpt/a", "--units"], ["list", "my ckpt"]]
    assert [c.output for c in found] == [("out 1", "out 2"), ()]
    assert rendered(block, [["new"], ["x", "y"]]) == [*found[0].lines, "new", found[1].lines[0], "x", "y"]
    text = "/tmp/f/ckpt/optim-0123456789ab-rank00000-of-00002.safetensors xxh3-128:00ff00ff00ff00ff00ff"
    assert normalise(text, Path("/tmp/f")) == "ckpt/optim-<id>-rank00000-of-00002.safetensors xxh3-128:..."


def test_console_blocks_exist() -> None:
    assert any(b.page == "docs/cli.md" and b.not_run is None for b in CONSOLE_BLOCKS), "docs/cli.md shows no real output"


@pytest.mark.parametrize("block", CONSOLE_BLOCKS, ids=[b.name for b in CONSOLE_BLOCKS])
def test_console_block_shows_real_output(block: Block, console_now: dict[str, list[str]]) -> None:
    if block.not_run is not None:
        assert block.not_run.strip(), f"{block.name}: a 'not run' marker must say why"
        pytest.skip(f"not run: {block.not_run}")
    now = console_now[block.name]
    if now != shown(block):
        diff = "\n".join(difflib.unified_diff(shown(block), now, f"{block.name} (docs)", f"{block.name} (now)", lineterm=""))
        pytest.fail(f"{block.name}: the output shown is not what fsdp-optim prints now; {HINT}.\n{diff}", pytrace=False)


def test_console_fixtures_are_the_same_bits_on_another_cpu(
    docs_job: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    """The console blocks' fixtures made again by a job whose ATen kernels run without AVX, as on another CPU
    (other vector widths, no fused multiply-add, other random numbers from the same seed): the weights and the
    optimizer state of every step compared come out bit for bit the same, so what the docs show does not depend
    on the machine."""
    failed, fixtures = docs_job
    assert FIXTURES not in failed, failed[FIXTURES]
    script = "import sys; from pathlib import Path; from docs.regenerate import build_fixtures; build_fixtures(Path(sys.argv[1]))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    made = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert made.returncode == 0, made.stderr[-4000:]
    for step in ("ckpt/step-00000004", "ckpt/step-00000008", "optim/step8"):
        report = fsdp_optim.diff(tmp_path / "fixtures" / step, fixtures / step)
        bitwise = report.equal and report.summary.tensors_equal == report.summary.tensors > 0
        assert bitwise, (step, report.differences[:3])
