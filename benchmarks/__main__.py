"""``python -m benchmarks``: the one runner of every benchmark in ``benchmarks/registry.py``.

    python -m benchmarks list                     # each benchmark: what it measures, its commands, runtimes, results
    python -m benchmarks run NAME [ARGS...]       # python -m benchmarks.<name> ARGS... (its own options, its own --help)
    python -m benchmarks run --quick NAME [ARGS...]   # its quick command, ARGS appended
    python -m benchmarks run --quick all          # every quick mode in turn, stopping at the first failure (= quick)
    python -m benchmarks report                   # the index of benchmarks/results/ into benchmarks/results/README.md

A benchmark runs as ``python -m benchmarks.<name>`` in a process of its own, exactly as when called so (those commands
keep working and are what results headers cite), with this checkout first on ``PYTHONPATH``: fairscale's wheel
installs a top-level package also called ``benchmarks``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from . import index
from .registry import BENCH, BENCHMARKS, RESULTS, Benchmark, find, results_files

USAGE = "usage: python -m benchmarks list | run [--quick] NAME|all [ARGS...] | quick | report"


def describe(bench: Benchmark) -> str:
    """The ``list`` entry of one benchmark."""
    present = [f for f in results_files(RESULTS) if bench.owns(f)]
    lines = [
        f"{bench.name}: {bench.measures}",
        f"  full:  {bench.command(bench.full)}   ({bench.full_time})",
        f"  quick: {bench.command(bench.quick)}   ({bench.quick_time})" if bench.quick is not None else "  quick: none",
        f"  results: {', '.join(present) if present else 'none committed'}",
    ]
    if bench.needs:
        lines.append(f"  needs: {', '.join(bench.needs)}")
    return "\n".join(lines)


def missing(bench: Benchmark) -> list[str]:
    """What ``bench.needs`` that this machine lacks."""
    lacking = [n for n in bench.needs if n != "cuda" and shutil.which(n) is None]
    if "cuda" in bench.needs:
        import torch

        lacking += [] if torch.cuda.is_available() else ["cuda"]
    return lacking


def run(bench: Benchmark, args: Sequence[str]) -> int:
    """``python -m benchmarks.<name> ARGS...`` in a child process; its exit code."""
    command = [sys.executable, "-m", bench.module, *args]
    print(f"== python -m {bench.module} {shlex.join(args)}".rstrip(), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(command, env=env, check=False).returncode


def quick_all() -> int:
    """Every benchmark's quick mode in registry order; stops at the first that fails, saying which and how."""
    done: list[str] = []
    for bench in (b for b in BENCHMARKS if b.quick is not None):
        if lacking := missing(bench):
            print(f"== skipped {bench.name}: needs {', '.join(lacking)}", flush=True)
            continue
        code = run(bench, shlex.split(bench.quick or ""))
        if code != 0:
            print(f"benchmarks quick: FAILED at {bench.name} (exit code {code}): `{bench.command(bench.quick)}`; "
                  f"passed before it: {', '.join(done) or 'none'}", file=sys.stderr)
            return code
        done.append(bench.name)
    print(f"benchmarks quick: all {len(done)} passed: {', '.join(done)}")
    return 0


def run_verb(argv: Sequence[str]) -> int:
    """``run [--quick] NAME|all [ARGS...]``: options before NAME are the runner's, everything after it the benchmark's."""
    quick = bool(argv) and argv[0] == "--quick"
    rest = list(argv[1:] if quick else argv)
    if not rest:
        print(f"benchmarks run: no benchmark named; {USAGE}", file=sys.stderr)
        return 2
    name, args = rest[0], rest[1:]
    if name == "all":
        if not quick or args:
            print("benchmarks run all: only `run --quick all` (no arguments); full runs take minutes to hours each, "
                  "run them one by one", file=sys.stderr)
            return 2
        return quick_all()
    try:
        bench = find(name)
    except KeyError as e:
        print(f"benchmarks run: {e.args[0]}", file=sys.stderr)
        return 2
    if quick and bench.quick is None:
        print(f"benchmarks run --quick {bench.name}: it has no quick mode; its full run: `{bench.command(bench.full)}` "
              f"({bench.full_time})", file=sys.stderr)
        return 2
    return run(bench, [*(shlex.split(bench.quick or "") if quick else []), *args])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb, rest = (argv[0], argv[1:]) if argv else ("", [])
    if verb == "list" and not rest:
        print("\n\n".join(describe(b) for b in BENCHMARKS))
        return 0
    if verb == "run":
        return run_verb(rest)
    if verb == "quick" and not rest:
        return quick_all()
    if verb == "report" and not rest:
        print(f"wrote {index.write(RESULTS).relative_to(BENCH.parent)}")
        return 0
    if verb in ("-h", "--help"):
        print(__doc__)
        return 0
    print(f"benchmarks: unknown command {shlex.join(argv)!r}; {USAGE}" if argv else f"benchmarks: no command; {USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
