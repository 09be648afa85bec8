"""The one job runner: start ``world_size`` fresh processes on one process group and bring every rank's result back
(``run_ranks``); run a checkpoint benchmark's world sizes one after another (``plan``, ``campaign``, ``jobs``: a job per
world size, its rows logged) in scratch directories (``scratch``) with the options they all take (``options``,
``resolve``).

The benchmark uses the tests' spawn helper (``tests/_dist.py``: one helper for every multi-process program
in this repository) with long timeouts, the backend chosen by the caller, deprecation notices silenced
in the ranks, and one intra-op thread per rank (``OMP_NUM_THREADS=1`` is inherited through the
environment). Run from the repository root, where ``tests`` is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests._dist import run_ranks as _run_ranks


def _quietly(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> Any:
    warnings.filterwarnings("ignore")  # FSDP1 deprecation and DCP notices, once per rank, per call
    return fn(rank, world_size, *args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    collective_timeout_s: float = 300,
    deadline_s: float = 1800,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return every rank's result.

    Raises ``RuntimeError`` with each failing rank's traceback, or when the deadline passes (ranks killed).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        return _run_ranks(
            _quietly, world_size, fn, *args, deadline_s=deadline_s, timeout_s=collective_timeout_s, backend=backend
        )
    except (AssertionError, TimeoutError) as exc:
        raise RuntimeError(f"world size {world_size}: {exc}") from exc


def csv(text: str) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")``: a comma-separated command-line option."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in csv(text))


# ---------------------------------------------------------------------------------------------------
# The checkpoint benchmarks' campaign: world sizes one after another, each loading another's checkpoint


def plan(sizes: tuple[int, ...]) -> dict[int, int | None]:
    """The other world size whose checkpoints each world size loads (and reshards to): the largest's for the
    others, the next smaller's for the largest."""
    if len(sizes) == 1:
        return {sizes[0]: None}
    return {w: (sizes[-1] if w != sizes[-1] else sizes[-2]) for w in sizes}


def campaign(sizes: tuple[int, ...], job: Callable[[int, bool], Any], done: Callable[[int, Any, set[int | None]], list[Any]], log: Callable[[str], None]) -> list[Any]:
    """Run ``job(world_size, source_only)`` (a function that spawns the job, returning rank 0's payload) for every
    world size in turn, the largest first as a source-only job when the others load its checkpoints; after each,
    ``done(world_size, payload, still_needed)`` returns its rows (``still_needed``: the world sizes whose
    checkpoints later jobs load, for the caller to keep)."""
    other = plan(sizes)
    if len(sizes) > 1:
        log(f"W={sizes[-1]}: saving the checkpoints the smaller world sizes load ...")
        job(sizes[-1], True)
    rows: list[Any] = []
    for k, world_size in enumerate(sizes):
        log(f"W={world_size} ...")
        rows += done(world_size, job(world_size, False), {other[w] for w in sizes[k + 1 :]})
    return rows


def jobs(sizes: tuple[int, ...], spec: Any, fn: Callable[..., Any], cfg: Callable[[int, bool], Any], report: Any, log: Callable[[str], None], *,
         after: Callable[[int, Any, set[int | None]], None] | None = None, before: Callable[[int], None] | None = None,
         timeout_s: float = 900, deadline_s: float = 1800) -> tuple[list[Any], dict[int, str]]:  # fmt: skip
    """:func:`campaign` of ``fn`` (a job's ranks) with ``cfg(world_size, source_only)``; after each job ``after(world_size,
    payload, still_needed)`` (the suite's own additions to the payload and its cleanup), then ``report.rows_of`` of the
    payload, logged and printed (``report.console``). Returns the rows and the load average before each measuring job."""
    from .host import load_average

    loads: dict[int, str] = {}

    def job(world_size: int, source_only: bool) -> Any:
        if not source_only:
            loads[world_size] = load_average()
            if before is not None:
                before(world_size)
        return run_ranks(fn, world_size, cfg(world_size, source_only), collective_timeout_s=timeout_s, deadline_s=deadline_s)[0]

    def done(world_size: int, payload: Any, needed: set[int | None]) -> list[Any]:
        if after is not None:
            after(world_size, payload, needed)
        rows = report.rows_of(spec.name, world_size, payload)
        log(f"{spec.name} ({spec.numel / 1e6:.1f}M params) W={world_size} done {payload['timings']}")
        print(report.console(rows), flush=True)
        return rows

    return campaign(sizes, job, done, log), loads


@contextlib.contextmanager
def scratch(prefix: str, directory: Path) -> Iterator[tuple[Path, Path]]:
    """Two fresh directories, removed at the end: one under ``directory`` (the checkpoints), one under the system's
    temporary directory (the references the checks compare with)."""
    root, refs = Path(tempfile.mkdtemp(prefix=prefix, dir=directory)), Path(tempfile.mkdtemp(prefix=f"{prefix}refs_"))
    try:
        yield root, refs
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(refs, ignore_errors=True)


def options(p: argparse.ArgumentParser, *, warmup: int, repeats: int, steps: int, storage: Path, name: str) -> None:
    """The options every checkpoint benchmark takes: --quick --world-sizes --warmup --repeats --steps --dir --out --name."""
    p.add_argument("--quick", action="store_true", help="smoke run: 5M model; writes to benchmarks/out/")
    p.add_argument("--world-sizes", type=lambda s: tuple(int(x) for x in s.split(",") if x.strip()), help="world sizes, comma-separated")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--repeats", type=int, help=f"timed calls per method (median reported; default {repeats})")
    p.add_argument("--steps", type=int, default=steps, help="Adam training steps before saving")
    p.add_argument("--dir", type=Path, help=f"where checkpoints are written (default {storage} if present)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results, --quick: benchmarks/out)")
    p.add_argument("--name", help=f"output file stem (default {name})")


def resolve(args: argparse.Namespace, *, world_sizes: tuple[int, ...], repeats: int, quick_repeats: int, storage: Path, name: str, quick_name: str = "") -> argparse.Namespace:
    """The defaults of :func:`options` that depend on --quick, and the scratch directory."""
    from .registry import RESULTS, SCRATCH

    args.world_sizes = tuple(sorted(set(args.world_sizes or world_sizes)))
    args.repeats = args.repeats or (quick_repeats if args.quick else repeats)
    args.dir = args.dir or (storage if storage.is_dir() and os.access(storage, os.W_OK) else Path(tempfile.gettempdir()))
    args.out = args.out or (SCRATCH if args.quick else RESULTS)
    args.name = args.name or ((quick_name or f"{name}_quick") if args.quick else name)
    return args
