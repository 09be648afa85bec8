"""``benchmarks/registry.py`` is the one list of benchmarks: every runnable module of ``benchmarks/`` is in it (as a
benchmark or as a tool of one), every committed results file belongs to a benchmark in it (or is listed as retired),
docs/benchmarks.md names the runner and every registered command, and ``benchmarks/results/README.md`` is the index
``python -m benchmarks report`` writes. The runner itself runs a benchmark (a real child process) and refuses bad
input with a clear message."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # fairscale's wheel installs a top-level ``benchmarks`` too

from benchmarks import index, registry  # noqa: E402


def _has_main(path: Path) -> bool:
    """Whether ``path`` runs something as ``__main__`` (an ``if __name__ == "__main__":`` block)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name):
            if node.test.left.id == "__name__":
                return True
    return False


def runnable_modules() -> set[str]:
    """``benchmarks.<name>`` names that ``python -m`` runs: packages with a ``__main__.py``, modules with a main block;
    but the runner itself."""
    names = set()
    for path in BENCH.rglob("*.py"):
        parts = path.relative_to(BENCH).with_suffix("").parts
        if parts == ("__main__",):
            continue
        if parts[-1] == "__main__":
            names.add(".".join(parts[:-1]))
        elif parts[-1] != "__init__" and _has_main(path):
            names.add(".".join(parts))
    return names


def test_every_runnable_module_is_registered() -> None:
    registered = {b.name for b in registry.BENCHMARKS}
    assert len(registered) == len(registry.BENCHMARKS), f"benchmarks registered twice: {[b.name for b in registry.BENCHMARKS]}"
    assert not registered & set(registry.TOOLS), f"both a benchmark and a tool: {registered & set(registry.TOOLS)}"
    found = runnable_modules()
    unregistered = found - registered - set(registry.TOOLS)
    assert not unregistered, f"benchmarks/ modules with a main missing from benchmarks/registry.py: {sorted(unregistered)}"
    stale = (registered | set(registry.TOOLS)) - found
    assert not stale, f"benchmarks/registry.py names modules that `python -m` cannot run: {sorted(stale)}"


def test_every_results_file_belongs_to_one_registered_benchmark() -> None:
    files = registry.results_files()
    assert files, f"no results files under {registry.RESULTS}"
    owners = {f: [b.name for b in registry.BENCHMARKS if b.owns(f)] for f in files}
    orphans = [f for f, o in owners.items() if not o and f not in registry.RETIRED]
    assert not orphans, f"results files of no registered benchmark (register them, or list them in RETIRED): {orphans}"
    shared = {f: o for f, o in owners.items() if len(o) > 1}
    assert not shared, f"results files claimed by more than one benchmark: {shared}"
    gone = sorted(set(registry.RETIRED) - set(files))
    assert not gone, f"RETIRED lists results files that are not there: {gone}"


def test_docs_name_the_runner_and_every_registered_command() -> None:
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    verbs = ["python -m benchmarks list", "python -m benchmarks run", "python -m benchmarks run --quick all", "python -m benchmarks report"]
    commands = [b.command(b.full) for b in registry.BENCHMARKS] + [b.command(b.quick) for b in registry.BENCHMARKS if b.quick is not None]
    missing = [c for c in verbs + commands if c not in docs]
    assert not missing, f"docs/benchmarks.md does not name these commands of benchmarks/registry.py: {missing}"


def test_results_index_is_current() -> None:
    stored = (registry.RESULTS / "README.md").read_text()
    assert index.markdown(index.entries()) == stored, "benchmarks/results/README.md is stale: run `python -m benchmarks report`"


def test_verdicts_are_counted_from_each_shape_of_targets() -> None:
    assert index.count_verdicts([{"met": True}, {"met": False}, {"met": None}]) == "1 PASS, 1 MISS, 1 other", "met rows"
    assert index.count_verdicts([{"verdict": "PASS"}, {"verdict": "**MISS**"}]) == "1 PASS, 1 MISS", "verdict rows"
    assert index.count_verdicts({"a": True, "b": True}) == "2 PASS, 0 MISS", "a mapping of target to bool"
    assert index.count_verdicts(None) == "", "no targets"


def _runner(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_runner_lists_every_benchmark() -> None:
    out = _runner("list")
    assert out.returncode == 0, f"python -m benchmarks list failed: {out.stderr}"
    missing = [b.name for b in registry.BENCHMARKS if f"\n{b.name}: " not in f"\n{out.stdout}" or b.command(b.full) not in out.stdout]
    assert not missing, f"python -m benchmarks list leaves out {missing}:\n{out.stdout}"


def test_runner_runs_a_benchmark_in_its_own_process() -> None:
    out = _runner("run", "format2", "--layout")
    assert out.returncode == 0, f"python -m benchmarks run format2 --layout failed: {out.stderr}"
    assert "== python -m benchmarks.format2 --layout" in out.stdout and "per dtype" in out.stdout, f"format2's table is not in the output:\n{out.stdout}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "nope"), "no benchmark 'nope': expected one of gather,"),
        (("run", "--quick", "scale"), "has no quick mode"),
        (("run", "all"), "only `run --quick all`"),
        (("run",), "no benchmark named"),
        (("frobnicate",), "unknown command"),
        ((), "no command"),
    ],
)
def test_runner_refuses_bad_input(args: tuple[str, ...], message: str) -> None:
    out = _runner(*args)
    assert out.returncode == 2 and message in out.stderr, f"python -m benchmarks {' '.join(args)}: {out.returncode}, {out.stderr!r}"


def test_quick_all_stops_at_the_first_failure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Three quick modes, each a real child process: one that passes, one that fails (a bad option), one never run."""
    import benchmarks.__main__ as runner

    def quick(args: str) -> registry.Benchmark:
        return registry.Benchmark("format2", "its header cost", "--layout", "", args, "")

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr(runner, "BENCHMARKS", (quick("--layout"), quick("--no-such-option"), quick("--layout --never-run")))
    assert runner.main(["quick"]) == 2, "a failed quick mode did not fail the run"
    out = capsys.readouterr()
    assert out.out.count("== python -m benchmarks.format2") == 2, f"did not stop at the failure:\n{out.out}"
    assert "FAILED at format2 (exit code 2): `python -m benchmarks.format2 --no-such-option`; passed before it: format2" in out.err, out.err
