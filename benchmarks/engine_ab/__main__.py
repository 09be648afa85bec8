"""A/B timing of every entry point against another commit: did a change slow a path down?

    python -m benchmarks.engine_ab --baseline ee12e15 [--current REV] [--model 25M] [--rounds 5]

Checks the baseline out into a temporary ``git worktree``, starts one SeaweedFS S3 server (``weed mini``, data on
tmpfs; ``benchmarks/storage/server.py``), then alternates one timing job per side (baseline, current, baseline,
...) so both see the same machine load. Each job is a world-size-2 gloo run (``tests/_dist.run_ranks``) of
``benchmarks/engine_ab/job.py`` importing that side's ``fsdp_optim`` (and refusing any other): the POSIX ops,
save and load of a whole checkpoint on each backend (local, fsspec, S3) and the memory tier's, listed there, the median
over ``--repeats`` calls each, against a fresh store prefix and a fresh ``/dev/shm`` memory directory, both removed
after the job. Prints the medians per side and the ratio current / baseline; writes
``benchmarks/results/engine_ab.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..peak import ROOT
from ..registry import RESULTS
from ..report import table
from ..storage import server
from .job import OPS

SHM = Path("/dev/shm")  # tmpfs: the server's data and the memory tier's directories

# Run in a fresh interpreter whose sys.path starts with the side's package alone, then this tree's benchmarks/, tests/.
CHILD = """import json, sys, tempfile; sys.path[:0] = sys.argv[1].split('|')
from _dist import run_ranks
from benchmarks.engine_ab.job import run
with tempfile.TemporaryDirectory() as d:
    r = run_ranks(run, 2, sys.argv[2], int(sys.argv[3]), {**json.loads(sys.argv[4]), "out": d}, deadline_s=900)
print(json.dumps({k: max(x[k] for x in r) for k in r[0]}))
"""


def _remove_prefix(srv: Any, url: str) -> None:
    """Delete what a job left under ``url`` (with s3fs, not either side's package), then compact the volumes."""
    import s3fs

    try:
        s3fs.S3FileSystem(**srv.endpoint.storage_options).rm(url, recursive=True)
    except FileNotFoundError:
        pass  # the job failed before saving there
    server.vacuum(srv)


def _run_side(checkout: Path, model: str, repeats: int, srv: Any) -> dict[str, float]:
    """One timing job importing ``checkout``'s fsdp_optim (tests/ and benchmarks/ always from here)."""
    url, memory = srv.endpoint.url("engine-ab"), tempfile.mkdtemp(prefix="fsdp_optim_engine_ab_", dir=SHM)
    work = {"checkout": str(checkout), "store_url": url, "storage_options": srv.endpoint.storage_options, "memory_dir": memory}
    try:
        with tempfile.TemporaryDirectory() as only:
            (Path(only) / "fsdp_optim").symlink_to(checkout / "fsdp_optim")  # nothing else of the checkout
            path = [only, str(ROOT), str(ROOT / "tests")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
            done = subprocess.run(
                [sys.executable, "-c", CHILD, "|".join(path), model, str(repeats), json.dumps(work)],
                env=env, capture_output=True, text=True, cwd=only,
            )  # fmt: skip
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        _remove_prefix(srv, url)
    if done.returncode:
        raise RuntimeError(f"timing job for {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rounds(args: argparse.Namespace, base: Path, current: Path) -> dict[str, list[dict[str, float]]]:
    """``--rounds`` pairs of jobs, the side that goes first alternating, against one S3 server."""
    sides: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory(prefix="fsdp_optim_engine_ab_s3_", dir=SHM) as data:
        srv = server.start(Path(data))
        try:
            for r in range(args.rounds):
                order = (("baseline", base), ("current", current))
                for side, checkout in order if r % 2 == 0 else order[::-1]:
                    sides[side].append(_run_side(checkout, args.model, args.repeats, srv))
                    times = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sides[side][-1].items())
                    print(f"round {r + 1}/{args.rounds} {side}: {times} ms", flush=True)
        finally:
            srv.stop()
    return sides


def _write(args: argparse.Namespace, sides: dict[str, list[dict[str, float]]]) -> None:
    med = {side: {op: statistics.median(run[op] for run in runs) for op in OPS} for side, runs in sides.items()}
    spread = {op: (min(r[op] for r in sides["current"]) / max(r[op] for r in sides["baseline"]),
                   max(r[op] for r in sides["current"]) / min(r[op] for r in sides["baseline"])) for op in OPS}
    lines = [
        f"# Engine A/B: {args.current or 'working tree'} vs {args.baseline} ({args.model}, W=2 gloo, {args.rounds} alternating rounds, "
        f"median of {args.repeats} calls per job; load average {os.getloadavg()[0]:.1f})",
        "",
        *table(["op", "baseline ms", "current ms", "current / baseline", "range of ratios over rounds"],
               ([op, f"{med['baseline'][op] * 1e3:.1f}", f"{med['current'][op] * 1e3:.1f}", f"{med['current'][op] / med['baseline'][op]:.2f}x",
                 f"{spread[op][0]:.2f}-{spread[op][1]:.2f}"] for op in OPS)),
    ]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    (RESULTS / "engine_ab.md").write_text(text + "\n")
    (RESULTS / "engine_ab.json").write_text(json.dumps({"baseline": args.baseline, "runs": sides, "median": med}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--baseline", required=True, help="commit to compare with (e.g. the parent of a change)")
    parser.add_argument("--current", help="commit to measure instead of the working tree (e.g. the change itself)")
    parser.add_argument("--model", default="25M")
    parser.add_argument("--rounds", type=int, default=5, help="alternating job pairs")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per op per job (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base, current = Path(tmp) / "baseline", Path(tmp) / "current" if args.current else ROOT
        for where, rev in ((base, args.baseline), (current, args.current)):
            if rev:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
        try:
            sides = _rounds(args, base, current)
        finally:
            for where in {base, current} - {ROOT}:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)
    _write(args, sides)


if __name__ == "__main__":
    main()
