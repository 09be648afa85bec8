"""A/B timing of every entry point against another commit: did a change slow a path down?

    python -m benchmarks.engine_ab --baseline ee12e15 [--current REV] [--model 25M] [--rounds 5]

Checks the baseline out into a temporary ``git worktree``, then alternates one timing job per side
(baseline, current, baseline, ...) so both see the same machine load. Each job is a world-size-2 gloo run
(``tests/_dist.run_ranks``) of the same model and Adam state, timing, with a barrier before each and the
median over ``--repeats``: gather, get_shard, save, load at the same layout, load re-cut for another
nesting, scatter of a full dict, and (rank 0, offline) consolidate and reshard to 3 ranks. Prints the
medians per side and the ratio current / baseline; writes ``benchmarks/results/engine_ab.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .peak import ROOT
from .report import RESULTS, table

OPS = ("gather", "get_shard", "save", "load", "load_recut", "scatter", "consolidate", "reshard")


def _job(rank: int, world_size: int, model_name: str, repeats: int, out: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from benchmarks.models import build, parse_model, train, wrap_fairscale
    from fsdp_optim import FullyShardedDataParallel as FSDP
    from fsdp_optim import (
        consolidate,
        load_sharded_optim_state,
        reshard,
        save_sharded_optim_state,
        scatter_full_optim_state,
    )

    spec = parse_model(model_name)
    model = wrap_fairscale(spec, torch.device("cpu"))
    optim = train(model, spec, 2, rank, torch.device("cpu"))
    other = FSDP(build(spec, torch.device("cpu")), flatten_parameters=True)  # another nesting: one root unit
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    fresh_other = torch.optim.Adam(other.parameters(), lr=1e-3)
    ckpt = os.path.join(out, "ckpt")
    full = model.gather_full_optim_state_dict(optim, recipient_rank=None)
    timed = {
        "gather": lambda: model.gather_full_optim_state_dict(optim),
        "get_shard": lambda: model.get_shard_from_optim_state_dict(full, optim=optim),
        "save": lambda: save_sharded_optim_state(model, optim, ckpt),
        "load": lambda: load_sharded_optim_state(model, fresh, ckpt),
        "load_recut": lambda: load_sharded_optim_state(other, fresh_other, ckpt),
        "scatter": lambda: scatter_full_optim_state(model, fresh, full if rank == 0 else None),
        "consolidate": lambda: consolidate(ckpt) if rank == 0 else None,
        "reshard": lambda: reshard(ckpt, 3, os.path.join(out, "r3")) if rank == 0 else None,
    }
    medians = {}
    for name, call in timed.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        dist.barrier()
        medians[name] = statistics.median(times)
    return medians


def _run_side(checkout: Path, model: str, repeats: int) -> dict[str, float]:
    """One timing job importing ``checkout``'s fsdp_optim (tests/ and benchmarks/ always from here)."""
    with tempfile.TemporaryDirectory() as only:
        (Path(only) / "fsdp_optim").symlink_to(checkout / "fsdp_optim")  # nothing else of the checkout
        path = [only, str(ROOT), str(ROOT / "tests")]
        code = (
            "import json, sys, tempfile; sys.path[:0] = sys.argv[1].split('|')\n"
            "from _dist import run_ranks\nfrom benchmarks.engine_ab import _job\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    r = run_ranks(_job, 2, sys.argv[2], int(sys.argv[3]), d, deadline_s=900)\n"
            "print(json.dumps({k: max(x[k] for x in r) for k in r[0]}))\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        done = subprocess.run(
            [sys.executable, "-c", code, "|".join(path), model, str(repeats)],
            env=env, capture_output=True, text=True, cwd=only,
        )
    if done.returncode:
        raise RuntimeError(f"timing job for {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
            sides: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
            for r in range(args.rounds):
                for side, checkout in (("baseline", base), ("current", current)) if r % 2 == 0 else (("current", current), ("baseline", base)):
                    sides[side].append(_run_side(checkout, args.model, args.repeats))
                    print(f"round {r + 1}/{args.rounds} {side}: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sides[side][-1].items()) + " ms", flush=True)
        finally:
            for where in {base, current} - {ROOT}:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)
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
    results = RESULTS
    (results / "engine_ab.md").write_text(text + "\n")
    (results / "engine_ab.json").write_text(json.dumps({"baseline": args.baseline, "runs": sides, "median": med}, indent=1))


if __name__ == "__main__":
    main()
