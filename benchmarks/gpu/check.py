"""``python -u -m benchmarks.gpu.check --out DIR [--suite] [--collect] [--budget S]``: what ``.ci/gpu-check`` runs on a
lent GPU machine, every step bounded by ``timeout``, its results in one JSON, ``DIR/gpu-check.json``.

Default mode, in phases (the steps of a phase run at once; each phase starts when the last one ended):

1. ``setup``: ``nvidia-smi``, and the imports the rest needs (torch with CUDA, the carried fairscale and
   parameterized);
2. ``checks``: the demo at ``--nproc_per_node 1`` (one GPU: NCCL) and ``4`` (more ranks than GPUs: gloo on the
   CPU, as ``fsdp_optim.demo`` chooses; each step checks the demo's first line says so), and every CUDA test:
   ``pytest -m gpu`` over the test files that mention CUDA (``tests/conftest.py`` marks a test ``gpu`` when a
   skip condition of it names CUDA or a GPU). tests/_gpu_plan.py writes which of them this machine runs and which
   need more GPUs than it has: those are reported "not applicable" with their reason; any other skip, or a test
   that could skip for an unstated reason, fails the step. A machine with several GPUs runs the multi-GPU ones;
3. ``d2h``: the 1 GiB device-to-host micro-check (:mod:`benchmarks.gpu.d2h`);
4. ``benchmark``: ``python -m benchmarks.gpu --repeats 1``, its rows (each with its floor and DCP's) and targets
   (the NCCL rows first; the rows measured so far when its bound ends it: it writes its results after each stage,
   marked partial).

``--suite`` runs the whole test suite instead of phases 2-4 (``pytest -n 16 -v`` when pytest-xdist is there), a
result per test in the JSON (from its XML; from its ``-v`` lines when its bound ended it first). ``--collect`` only
collects what a run would select (``pytest --collect-only``) and the CUDA tests' plan for ``--gpus`` (default 1),
nothing else: a test runs it on a device-like image here. Each step's status, seconds and output tail go into the
JSON; its whole output into ``DIR/gpu-check.log``. ``--budget`` (seconds, default 175: one H100 within 180 s;
``--suite`` 470) bounds the whole run: a step's timeout is cut to what is left of it. Exit status 0 when every step
passed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.steps import Step, run_phase
from benchmarks.gpu.summary import judge_cuda_tests, junit_results, last_json, summary_lines, verbose_results

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = "/dev/shm/fsdp_optim_gpu_bench"
CHECKS_BUDGET_S = 175.0  # one H100 within 180 s
SUITE_BUDGET_S = 470.0  # under 8 minutes
PLAN = "cuda-plan.json"  # tests/_gpu_plan.py: which CUDA tests run here, which are not applicable and why
SKIP_MISSING = ("FSDP_OPTIM_MISSING_EXTRAS", "skip")  # tests/_extras.py: what the image lacks skips, saying so
DEMO_SAYS = {1: "fsdp_optim demo on GPUs (nccl)", 4: "fsdp_optim demo on the CPU (gloo)"}  # one GPU


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test files that mention CUDA: where every CUDA test is (``pytest -m gpu`` selects them in these)."""
    files = sorted((root / "tests").glob("test_*.py"))
    return [str(p.relative_to(root)) for p in files if "cuda" in p.read_text().lower()]


def _pytest(args: list[str], junit: Path, *, collect: bool, workers: int) -> tuple[str, ...]:
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs"]
    if collect:
        return tuple(base + ["--collect-only"] + args)
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") is not None else []
    return tuple(base + parallel + [f"--junitxml={junit}"] + args)


def _setup(collect: bool) -> list[Step]:
    probe = ("import torch, fairscale, parameterized; "
             "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), "
             "'gpus', torch.cuda.device_count(), '| fairscale', fairscale.__version__, 'from', fairscale.__file__)")  # fmt: skip
    if not collect:
        probe += "; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
    steps = [Step("imports", (sys.executable, "-c", probe), 40)]
    return steps if collect else [Step("nvidia-smi", ("nvidia-smi",), 15), *steps]


def default_phases(tmp: Path, collect: bool, gpus: int | None = None) -> list[list[Step]]:
    """The phases of the module doc; ``gpus`` makes the CUDA tests' plan for that many GPUs (default: those here)."""
    plan_env = (("FSDP_OPTIM_GPU_PLAN", str(tmp / PLAN)),) + ((("FSDP_OPTIM_GPUS", str(gpus)),) if gpus is not None else ())
    tests = Step("cuda tests", _pytest(["-m", "gpu", *cuda_test_files()], tmp / "cuda.xml", collect=collect, workers=4), 70,
                 env=(("OMP_NUM_THREADS", "2"), SKIP_MISSING, *plan_env), stop_signal="INT")  # fmt: skip
    if collect:
        return [_setup(collect), [tests]]
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone")  # the console script may be off PATH
    demos = [Step(f"demo nproc_per_node={n}", (*torchrun, "--nproc_per_node", str(n), "-m", "fsdp_optim.demo", "--steps", "4"),
                  60, env=(("OMP_NUM_THREADS", "2"),), expect=DEMO_SAYS[n]) for n in (1, 4)]  # fmt: skip
    d2h = Step("d2h 1 GiB", (sys.executable, "-u", "-m", "benchmarks.gpu.d2h", "--gib", "1"), 20)
    # whatever is left of the budget (about 100 s); the NCCL rows first, every stage published as it ends
    bench = Step("benchmark", (sys.executable, "-u", "-m", "benchmarks.gpu", "--repeats", "1", "--dir", BENCH_DIR, "--out", str(tmp)), 150)
    return [_setup(collect), [*demos, tests], [d2h], [bench]]


def suite_phases(tmp: Path, collect: bool) -> list[list[Step]]:
    # -v: a line per test as it ends (the per-test result when the bound ends pytest before its XML is written)
    suite = Step("suite", _pytest([*([] if collect else ["-v"]), "--durations=15", "tests"], tmp / "suite.xml", collect=collect, workers=16), int(SUITE_BUDGET_S) - 10,
                 env=(("OMP_NUM_THREADS", "1"), SKIP_MISSING), stop_signal="INT")  # fmt: skip
    return [_setup(collect), [suite]]


def _results(outcomes: dict[str, dict[str, Any]], tmp: Path, out: Path) -> dict[str, Any]:
    """What the steps produced besides their status: test outcomes, the micro-check's rows, the benchmark's."""
    found: dict[str, Any] = {}
    for name, xml in (("cuda tests", "cuda.xml"), ("suite", "suite.xml")):
        if (tmp / xml).exists():
            found[name] = junit_results(tmp / xml, every=True)
        elif name in outcomes and "--collect-only" not in outcomes[name]["command"]:
            found[name] = verbose_results(outcomes[name]["log_lines"])
    if "cuda tests" in outcomes:
        _judge_cuda(outcomes["cuda tests"], found, tmp / PLAN)
    if "d2h 1 GiB" in outcomes:
        found["d2h"] = last_json(outcomes["d2h 1 GiB"]["log_lines"])
    bench = tmp / "gpu_staging.json"  # this run's, maybe partial
    if bench.exists():
        stored = json.loads(bench.read_text())
        found["benchmark"] = {k: stored[k] for k in ("rows", "targets", "meta")}
        for suffix in ("json", "md"):
            shutil.copy(tmp / f"gpu_staging.{suffix}", out / f"gpu_staging.{suffix}")
    for name, outcome in outcomes.items():
        if "--collect-only" in outcome["command"]:
            found.setdefault("collected", {})[name] = [line for line in outcome["log_lines"] if "::" in line]
    return found


def _judge_cuda(outcome: dict[str, Any], found: dict[str, Any], plan_path: Path) -> None:
    """Only a stated missing resource (too few GPUs) may keep a CUDA test from running: reported not applicable,
    with its reason; any other skip, or a test that could skip otherwise, fails the step (collecting too)."""
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else None
    if plan is not None:
        found["cuda plan"] = plan
    if outcome["status"] != "passed":
        return
    if "--collect-only" in outcome["command"]:
        problem = _judge_plan(plan)
    else:
        problem, not_applicable = judge_cuda_tests(found.get("cuda tests", {}), plan)
        found.setdefault("cuda tests", {})["not applicable"] = not_applicable
    if problem:
        outcome["status"] = f"failed: {problem}"


def _judge_plan(plan: dict[str, Any] | None) -> str | None:
    if plan is None:
        return "no plan of the CUDA tests was written (tests/_gpu_plan.py)"
    return f"{len(plan['unexplained'])} may skip for an unstated reason: {plan['unexplained']}" if plan["unexplained"] else None


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(phases: list[list[Step]], out: Path, tmp: Path, budget: float, outcomes: dict[str, dict[str, Any]]) -> None:
    """Each phase in turn, every step's outcome into ``outcomes`` (``not run`` for those after the budget's end)."""
    deadline = time.monotonic() + budget
    with open(out / "gpu-check.log", "w") as log:
        for phase in phases:
            left = deadline - time.monotonic()
            if left < 10:
                outcomes |= {s.name: s.not_run(f"budget spent ({budget:.0f} s)") for s in phase}
                continue
            outcomes |= run_phase(phase, tmp, log, left)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where gpu-check.json and gpu-check.log go")
    parser.add_argument("--suite", action="store_true", help="the whole test suite instead of the checks")
    parser.add_argument("--collect", action="store_true", help="only collect the tests a run would select")
    parser.add_argument("--budget", type=float, default=None, help=f"seconds for the whole run (default {CHECKS_BUDGET_S:.0f}, --suite {SUITE_BUDGET_S:.0f})")
    parser.add_argument("--gpus", type=int, default=None, help="the GPUs to plan the CUDA tests for (default: those here; --collect: 1)")
    args = parser.parse_args(argv)
    args.budget = args.budget or (SUITE_BUDGET_S if args.suite else CHECKS_BUDGET_S)
    gpus = 1 if args.collect and args.gpus is None else args.gpus
    signal.signal(signal.SIGTERM, _interrupt)
    args.out.mkdir(parents=True, exist_ok=True)
    mode = ("suite" if args.suite else "checks") + (" (collect only)" if args.collect else "")
    record: dict[str, Any] = {"mode": mode, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "commit": _commit(), "budget_s": args.budget}  # fmt: skip
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as name:
        tmp = Path(name)
        phases = suite_phases(tmp, args.collect) if args.suite else default_phases(tmp, args.collect, gpus)
        outcomes: dict[str, dict[str, Any]] = {}
        try:
            run(phases, args.out, tmp, args.budget, outcomes)
        except KeyboardInterrupt as exc:
            record["interrupted"] = str(exc)
            outcomes |= {s.name: s.not_run(f"interrupted ({exc}): ended or never started") for p in phases for s in p if s.name not in outcomes}
        finally:
            record["seconds"] = round(time.monotonic() - start, 1)
            record["results"] = _results(outcomes, tmp, args.out)
            record["steps"] = [{k: v for k, v in o.items() if k not in ("log", "log_lines")} for o in outcomes.values()]
            record["ok"] = bool(outcomes) and "interrupted" not in record and all(o["status"] == "passed" for o in outcomes.values())
            (args.out / "gpu-check.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print("\n".join(summary_lines(record)), flush=True)
    return 0 if record["ok"] else 1


def _commit() -> str:
    """The commit the tree came from (``.ci/gpu-check`` reads the carry's ``COMMIT``: the tree travels without .git)."""
    return os.environ.get("GPU_CHECK_COMMIT", "unknown")


if __name__ == "__main__":
    sys.exit(main())
