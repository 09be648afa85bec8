"""``python -m docs.regenerate``: rewrite the output of every ``$ fsdp-optim ...`` command in the docs from real runs.

Every ```` ```console ```` block of README.md and docs/*.md holding a ``$ fsdp-optim`` line is regenerated, unless
the line before its fence says ``<!-- not run: REASON -->``. The fixtures the commands name are made once, in a
temporary directory, by a real 2-rank gloo job (:func:`make_fixtures`):

    ckpt/                   a CheckpointManager root (every=2) of a whole checkpoint at world size 2, Adam:
      step-00000002           complete
      step-00000004           complete
      step-00000006           damaged (one byte of rank 1's file flipped)
      step-00000008           complete
      step-00000010           torn (the files of a save, no manifest)
    optim/step8             an optimizer-only sharded checkpoint (save_sharded_optim_state) of the same step
    fairscale_optim.pt      fairscale's own gather_full_optim_state_dict of it (names no parameters)

Each page's blocks run in document order in a fresh copy of the fixtures (a later command may read what an earlier
one wrote), each command in this process (``fsdp_optim.cli.main``, stdout and stderr together, as a terminal shows
them but with no progress bars: the output is not a terminal). What varies from run to
run is normalised (:func:`normalise`): the fixture directory's path, save ids, checksums, a DCP export's size.
``tests/test_docs.py`` runs the same commands and fails when the docs differ, naming this command;
``python -m docs.regenerate --check`` does the same without a test run.

A command may span lines (``\\`` at the end of a line) and carry a ``# comment``; both are kept as written.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import shlex
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from docs.blocks import ROOT, Block, blocks, pages

if TYPE_CHECKING:
    import torch

FIXTURE_WORLD_SIZE = 2
PROMPT = "$ "
COMMAND = "fsdp-optim"
HINT = "run `python -m docs.regenerate` to rewrite them from real runs, then review and commit the diff"


# ---- the fixtures


def _docs_model() -> type:
    import torch

    class DocsModel(torch.nn.Module):
        """The model of the examples: three Linear layers, one buffer; ``block`` gets an FSDP unit of its own."""

        def __init__(self) -> None:
            super().__init__()
            self.embed, self.block, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)  # type: ignore[operator]
            return self.head(torch.relu(self.block(torch.relu(self.embed(x)))))

    return DocsModel


def _exact(numel: int, salt: int) -> torch.Tensor:
    """``numel`` float32 values, small integers over 64 (-8/64 .. 8/64): exact, and the same on every machine."""
    import torch

    index = torch.arange(numel, dtype=torch.float32)
    return ((index * 7 + salt) % 17 - 8) / 64


def _exact_gradients(model: torch.nn.Module, step: int, rank: int) -> None:
    """Replace each flat shard's gradient by exact values (:func:`_exact`), zero in the padding as FSDP's are.

    What the docs show must be the same on every machine, and it holds values (``diff``'s errors and ULP
    distances). A backward's matmuls sum in an order each CPU's kernels choose (AVX-512, AVX2, none), and
    ``torch.manual_seed``'s random numbers differ between CPU kernels too: the state trained from them differs
    in its last bits from machine to machine. From exact weights and gradients, with betas that keep Adam's
    moments exact (0.5, 0.75: a few bits more a step; a lerp or multiply-add fused on one CPU and not on another
    then rounds nothing), Adam's update is made of single correctly rounded operations (a square root, a
    division, a sum): every machine saves the same bits."""
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    for unit in model.modules():
        if not isinstance(unit, FairscaleFSDP):
            continue
        for flat, padded in zip(unit.params, unit.numel_padded_per_param, strict=True):
            grad = _exact(flat.numel(), 3 * step + 5 * rank)
            grad[grad.numel() - padded :] = 0
            flat.grad = grad.view_as(flat)


def make_fixtures(rank: int, world_size: int, root: str) -> None:
    """On every rank of a ``FIXTURE_WORLD_SIZE``-rank gloo job (the default group initialised): train a small
    nested FSDP model for 10 steps under a CheckpointManager, save the optimizer alone and fairscale's own full
    dict; then rank 0 damages one step and tears another, as a crash and a bad copy would.

    The weights start from exact values, and each step runs a forward and a backward as training does (FSDP's
    hooks, the reduce-scatter, the buffer's update), then steps on exact gradients (:func:`_exact_gradients`
    says why): what the docs show is the same on every machine."""
    import torch
    import torch.distributed as dist
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    import fsdp_optim
    from fsdp_optim import FullyShardedDataParallel as FSDP

    assert world_size == FIXTURE_WORLD_SIZE, world_size
    base = Path(root)
    net = _docs_model()()
    with torch.no_grad():
        for i, param in enumerate(net.parameters()):
            param.copy_(_exact(param.numel(), i).view_as(param))
    net.block = FSDP(net.block)
    model = FSDP(net)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.5, 0.75))  # see _exact_gradients
    manager = fsdp_optim.CheckpointManager(base / "ckpt", every=2, keep=10)
    for step in range(1, 11):
        model(torch.full((4, 8), step / 8 - rank)).square().mean().backward()
        _exact_gradients(model, step, rank)
        optim.step()
        optim.zero_grad()
        if step < 10:
            manager.save(step, model, optim, extra={"step": step})
        if step == 8:
            fsdp_optim.save_sharded_optim_state(model, optim, base / "optim" / "step8")
            native = FairscaleFSDP.gather_full_optim_state_dict(model, optim)  # fairscale's own, not ours
            if rank == 0:
                torch.save(native, base / "fairscale_optim.pt")
    # Step 10: a save whose manifest never came (a run killed between its rank files and its commit).
    fsdp_optim.save_checkpoint(model, optim, base / "ckpt" / "step-00000010", extra={"step": 10})
    dist.barrier()
    if rank == 0:
        (base / "ckpt" / "step-00000010" / "manifest.json").unlink()
        victim = next((base / "ckpt" / "step-00000006").glob("optim-*-rank00001-of-00002.safetensors"))
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))


def build_fixtures(root: Path) -> Path:
    """The fixtures in ``root / "fixtures"``, made by a fresh 2-rank job (for ``python -m docs.regenerate``; the
    test makes them in the job it already runs)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _dist import run_ranks  # type: ignore[import-not-found] # tests/ holds the one job helper

    out = root / "fixtures"
    out.mkdir()
    run_ranks(make_fixtures, FIXTURE_WORLD_SIZE, str(out))
    return out


# ---- the blocks and their commands


@dataclass(frozen=True)
class Command:
    """One ``$ fsdp-optim ...`` command of a block: its lines as written (continuations included) and the output
    lines the docs show after it."""

    lines: tuple[str, ...]
    output: tuple[str, ...]

    @property
    def argv(self) -> list[str]:
        text = " ".join(line.rstrip("\\").strip() for line in self.lines)
        words = shlex.split(text[len(PROMPT) :], comments=True)
        assert words and words[0] == COMMAND, self.lines
        return words[1:]


def console_blocks() -> list[Block]:
    """Every console block holding a ``$ fsdp-optim`` line, those marked not run included."""
    return [
        b
        for path in pages()
        for b in blocks(path)
        if b.lang == "console" and any(line.startswith(PROMPT + COMMAND) for line in b.body.splitlines())
    ]


def commands(block: Block) -> list[Command]:
    """The block's commands with what follows each; every ``$ `` line of a block to regenerate is fsdp-optim's."""
    found: list[Command] = []
    lines = block.body.splitlines()
    i = 0
    assert lines and lines[0].startswith(PROMPT), f"{block.name}: a console block starts with a '$ ' command"
    while i < len(lines):
        start = i
        while lines[i].endswith("\\"):
            i += 1
        i += 1
        stop = i
        while i < len(lines) and not lines[i].startswith(PROMPT):
            i += 1
        found.append(Command(tuple(lines[start:stop]), tuple(lines[stop:i])))
    return found


# ---- running them


NORMALISE: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(xxh3-128|sha256):[0-9a-f]{8,}"), r"\1:..."),  # checksums
    (re.compile(r"\b(optim|train)-[0-9a-f]{12}-rank"), r"\1-<id>-rank"),  # save ids in file names
    (re.compile(r"(save id:? )[0-9a-f]{12}\b"), r"\1<id>"),
    # A DCP directory's metadata pickles the path it was written to: its size varies with the fixtures' path.
    (re.compile(r"^(wrote .*\(dcp, .*?, )[\d.]+ (?:[KMGT]iB \(\d+ B\)|B\b)", re.M), r"\1<bytes>"),
]


def normalise(text: str, fixtures: Path) -> str:
    """What varies between runs made the same: the fixtures' path, save ids, checksums, the size of a DCP export
    (its metadata holds the path); no trailing spaces."""
    for where in {str(fixtures), str(fixtures.resolve())}:
        text = text.replace(where + os.sep, "").replace(where, ".")
    for pattern, replacement in NORMALISE:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines())


@contextlib.contextmanager
def _in(directory: Path) -> Iterator[None]:
    here = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(here)


def run_command(argv: list[str], cwd: Path) -> list[str]:
    """``fsdp-optim ARGV`` in ``cwd``: its stdout and stderr together, normalised, as lines.

    What Python prints is captured in order; file descriptors 1 and 2 point at a file meanwhile, so nothing the
    command asks of them sees a terminal (no progress bars, whoever runs this), and what is written to them
    directly (a C++ warning) is appended."""
    from fsdp_optim.cli import main

    captured = io.StringIO()
    with tempfile.TemporaryFile() as raw, _in(cwd):
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(raw.fileno(), 1)
        os.dup2(raw.fileno(), 2)
        try:
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                with warnings.catch_warnings():
                    warnings.simplefilter("default")  # as a fresh process: each warning once
                    try:
                        main(argv)
                    except SystemExit:  # argparse's usage errors
                        pass
        finally:
            for fd, original in zip((1, 2), saved):
                os.dup2(original, fd)
                os.close(original)
        raw.seek(0)
        text = captured.getvalue() + raw.read().decode(errors="replace")
    return normalise(text, cwd).splitlines()


def page_blocks(fixtures: Path, workdir: Path) -> Iterator[tuple[Path, Block, list[list[str]]]]:
    """For each console block to regenerate, page by page in document order: the output of each of its commands,
    run in a copy of the fixtures that page's blocks share."""
    by_page: dict[str, list[Block]] = {}
    for b in console_blocks():
        if b.not_run is None:
            by_page.setdefault(b.page, []).append(b)
    for page, found in by_page.items():
        where = workdir / page.replace("/", "_")
        shutil.copytree(fixtures, where)
        for b in found:
            yield ROOT / page, b, [run_command(c.argv, where) for c in commands(b)]


def rendered(block: Block, outputs: list[list[str]]) -> list[str]:
    """The block's body with each command's output replaced by ``outputs``."""
    lines: list[str] = []
    for command, output in zip(commands(block), outputs, strict=True):
        lines += [*command.lines, *output]
    return lines


def shown(block: Block) -> list[str]:
    return [line for c in commands(block) for line in (*c.lines, *c.output)]


def differences(fixtures: Path, workdir: Path) -> list[str]:
    """A unified diff per block whose output in the docs is not what the commands print now."""
    found = []
    for _, b, outputs in page_blocks(fixtures, workdir):
        now = rendered(b, outputs)
        if now != shown(b):
            diff = difflib.unified_diff(shown(b), now, f"{b.name} (docs)", f"{b.name} (now)", lineterm="")
            found.append("\n".join(diff))
    return found


def rewrite(fixtures: Path, workdir: Path, say: Callable[[str], object] = print) -> int:
    """Rewrite every block in place; the number of blocks changed."""
    changed: dict[Path, list[tuple[Block, list[str]]]] = {}
    for path, b, outputs in page_blocks(fixtures, workdir):
        now = rendered(b, outputs)
        if now != shown(b):
            changed.setdefault(path, []).append((b, now))
    for path, todo in changed.items():
        lines = path.read_text().splitlines()
        for b, now in sorted(todo, key=lambda t: -t[0].start):  # from the end: earlier indices stay valid
            indent = re.match(r" *", lines[b.start - 1])[0]  # type: ignore[index]
            lines[b.start : b.stop] = [indent + line if line else line for line in now]
            say(f"rewrote {b.name}")
        path.write_text("\n".join(lines) + "\n")
    return sum(len(t) for t in changed.values())


def main(argv: list[str] | None = None) -> int:
    """Rewrite the blocks; ``--check``: rewrite nothing, print each block's diff and exit 1 if any differs."""
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="fsdp-optim-docs-") as tmp:
        fixtures = build_fixtures(Path(tmp))
        if check:
            found = differences(fixtures, Path(tmp) / "pages")
            print("\n".join(found) + f"\n{len(found)} console block(s) differ; {HINT}" if found else "up to date")
            return 1 if found else 0
        n = rewrite(fixtures, Path(tmp) / "pages")
    print(f"{n} console block(s) rewritten" if n else "every console block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
