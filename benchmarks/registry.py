"""Every benchmark, once: its module, what it measures, its full and quick commands with their rough runtimes (as
docs/benchmarks.md states them), what it needs beyond this package, and its committed results files. The runner
(``python -m benchmarks``) and ``tests/test_benchmarks_tree.py`` read this table; nothing else lists the benchmarks.

Imports nothing heavy (no torch), so that ``python -m benchmarks list`` answers at once.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"  # committed: the latest full runs
SCRATCH = BENCH / "out"  # git-ignored: quick and ad-hoc runs


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``python -m benchmarks.<name> [full]`` runs it fully, ``... [quick]`` quickly (None: it has no
    quick mode). ``results``: globs under ``benchmarks/results/`` of the files its runs wrote and the docs cite.
    ``needs``: executables on PATH, or ``"cuda"``, without which it cannot run here."""

    name: str
    measures: str
    full: str
    full_time: str
    quick: str | None = None
    quick_time: str = ""
    results: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return f"benchmarks.{self.name}"

    def command(self, args: str | None) -> str:
        """The shell command of a run with ``args`` (``self.full`` or ``self.quick``)."""
        return f"python -m {self.module} {args or ''}".strip()

    def owns(self, relative: str) -> bool:
        """Whether ``relative`` (a path under ``benchmarks/results/``, with ``/``) is one of this benchmark's files."""
        return any(fnmatch.fnmatchcase(relative, pattern) for pattern in self.results)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "gather", "gathering sharded Adam state into one full dict, against fairscale, FSDP1/2 and the floors",
        "", "~25 min on 2 cores", "--quick", "about a minute", ("latest.*",),
    ),
    Benchmark(
        "checkpoint", "optimizer-state save, async save, load, consolidate and reshard against PyTorch DCP and the floors",
        "", "~21-26 min on 2 cores", "--quick", "about a minute", ("checkpoint_latest.*", "checkpoint_100M_*"),
    ),
    Benchmark(
        "ckpt.profile", "where our sharded save and load spend their time (cProfile on every rank)",
        "", "not stated", None, "", ("checkpoint_profile.*",),
    ),
    Benchmark(
        "whole_state", "whole-state save_checkpoint / load_checkpoint against DCP and fairscale's full state dicts",
        "", "~6-8 min on 2 cores", "--quick", "~2-3 min on a loaded 2-core machine", ("whole_state.*",),
    ),
    Benchmark(
        "gpu", "save, async save and load on one GPU against the PCIe floor and DCP (its CPU mode with --small)",
        "", "not stated", "--small --out benchmarks/out", "0.2 min (results/gpu_staging_small.md)",
        ("gpu_staging*", "gpu-check.*"),
    ),
    Benchmark(
        "gpu.d2h", "device-to-host copy speed into registered, pinned and pageable host memory",
        "", "not stated", None, "", (), ("cuda",),
    ),
    Benchmark(
        "storage", "whole checkpoints to and from S3 against s3fs floors and DCP's FsspecWriter / FsspecReader",
        "--dir /tmp", "~12-16 min on 2 cores", None, "", ("storage.*",), ("weed",),
    ),
    Benchmark(
        "memory_tier", "the memory tier's save and a restore after losing a node, against async save and a local load",
        "", "~3-5 min on 2 cores", "--quick", "not stated", ("memory_tier.*",),
    ),
    Benchmark(
        "memory", "offline tools' peak memory and time (dcp_export, named_safetensors, diff, checkpoint, fairseq, verify)",
        "all", "not stated", "all --small", "~3 min",
        ("dcp_export.*", "diff.*", "fairseq_memory.*", "verify_speed.*"),
    ),
    Benchmark(
        "scale", "offline reshard / consolidate / inspect, planning and jobs with many ranks and units",
        "", "~2 min", None, "", ("scale.*", "scale_fresh.*", "jobs32/scale.*"),
    ),
    Benchmark(
        "offline_parallel", "offline reshard by one process against torchrun's 2, and the planner simulated at scale",
        "", "not stated", "--no-run --out benchmarks/out", "seconds",
        ("offline_parallel.*", "offline_16g.*"),
    ),
    Benchmark(
        "engine_ab", "A/B timing of every entry point against another commit (did a change slow a path down?)",
        "--baseline HEAD~1", "not stated", None, "", ("engine_ab.*", "engine_ab_*"), ("weed",),
    ),
    Benchmark(
        "format2", "the rank-file header cost of one tensor per (unit, key) against one per dtype (format 3's layout)",
        "--layout", "not stated", None, "", (),
    ),
    Benchmark(
        "census", "the source tree's counts: lines, Location members, failure captures, forwarding imports, names "
        "defined twice, docs/api.md entries at internal paths, dead functions", "", "seconds", None, "", (),
    ),
)

# Modules with a main that are parts of a benchmark, not benchmarks: what each is for.
TOOLS: dict[str, str] = {
    "gpu.check": "what .ci/gpu-check runs on a lent GPU machine",
    "gpu.carry": "copies the pure-Python packages the GPU image lacks (.ci/gpu-check --prepare)",
    "offline_parallel.worker": "one process of benchmarks.offline_parallel's runs",
    "scale.fresh": "one fresh interpreter of benchmarks.scale --fresh (reshard's first and second call)",
}

# Results files of no registered benchmark (a retired one's), with why they stay: none today.
RETIRED: dict[str, str] = {}


def find(name: str) -> Benchmark:
    """The benchmark called ``name`` (``gather``, ``ckpt.profile``, or its module ``benchmarks.gather``)."""
    name = name.removeprefix("benchmarks.")
    for bench in BENCHMARKS:
        if bench.name == name:
            return bench
    known = ", ".join(b.name for b in BENCHMARKS)
    raise KeyError(f"no benchmark {name!r}: expected one of {known} (see `python -m benchmarks list`)")


def owner(relative: str) -> Benchmark | None:
    """The benchmark whose results file ``relative`` is (a path under ``benchmarks/results/``), or None."""
    return next((b for b in BENCHMARKS if b.owns(relative)), None)


def results_files(root: Path = RESULTS) -> list[str]:
    """Every results file under ``root`` but its index (``README.md``), as paths relative to it with ``/``, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "README.md")
