"""What ``.ci/gpu-check`` (:mod:`benchmarks.gpu.check`) reads back from its steps: pytest's JUnit XML, a step's
last JSON line, and the closing summary it prints."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

MESSAGE_CHARS = 600


def _outcome(case: ET.Element) -> tuple[str, str]:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        found = case.find(tag)
        if found is not None:
            return outcome, (found.get("message") or found.text or "")[:MESSAGE_CHARS]
    return "passed", ""


def junit_results(path: Path, *, every: bool) -> dict[str, Any]:
    """Counts per outcome, skip reasons with their counts, and the tests that failed (``every``: all tests)."""
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = _outcome(case)
        counts[outcome] += 1
        if outcome == "skipped":
            reasons[message] += 1
        test = {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                "seconds": round(float(case.get("time") or 0), 2), "message": message}  # fmt: skip
        if every or outcome in ("failed", "error"):
            tests.append(test)
    return {"counts": dict(counts), "skip_reasons": dict(reasons.most_common()), "tests": tests}


VERBOSE = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+::\S+)")
VERBOSE_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error", "XFAIL": "skipped", "XPASS": "passed"}


def verbose_results(lines: list[str]) -> dict[str, Any]:
    """:func:`junit_results`'s shape from ``pytest -v`` lines (``[gw3] [ 12%] PASSED tests/test_gather.py::test_y``):
    each test that ended before a bound stopped pytest without its XML; ``partial`` says so."""
    counts: Counter[str] = Counter()
    tests = []
    for line in lines:
        found = VERBOSE.search(line)
        if found and "::" in found.group(2):
            outcome = VERBOSE_OUTCOMES[found.group(1)]
            counts[outcome] += 1
            tests.append({"test": junit_id(found.group(2)), "outcome": outcome, "seconds": None, "message": ""})
    return {"counts": dict(counts), "skip_reasons": {}, "tests": tests, "partial": "from the -v lines: pytest wrote no XML"}


def junit_id(nodeid: str) -> str:
    """pytest's node id as :func:`junit_results` names a test: ``tests/test_gather.py::C::t`` -> ``tests.test_gather.C::t``."""
    path, _, rest = nodeid.partition("::")
    *classes, name = rest.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *classes]) + f"::{name}"


def judge_cuda_tests(found: dict[str, Any], plan: dict[str, Any] | None) -> tuple[str | None, dict[str, str]]:
    """Why the CUDA tests fail besides a failing test (None when nothing else is wrong), and the tests found not
    applicable here with their reasons.

    ``found`` is :func:`junit_results` of a run with ``every``; ``plan`` what tests/_gpu_plan.py wrote for it (None
    when it wrote none). A skipped test is not applicable when the plan says this machine has too few GPUs for it;
    any other skip is unexpected, and so is a test the plan says could skip for an unstated reason.
    """
    if plan is None:
        return "no plan of the CUDA tests was written (tests/_gpu_plan.py)", {}
    allowed = {junit_id(test): reason for test, reason in plan["not_applicable"].items()}
    skipped = [t for t in found.get("tests", []) if t["outcome"] == "skipped"]
    not_applicable = {t["test"]: allowed[t["test"]] for t in skipped if t["test"] in allowed}
    unexpected = [f"{t['test']} ({t['message']})" for t in skipped if t["test"] not in allowed]
    problems = [f"{len(unexpected)} unexpected skips: {'; '.join(unexpected)}"] if unexpected else []
    problems += [f"{len(plan['unexplained'])} may skip for an unstated reason: {plan['unexplained']}"] if plan["unexplained"] else []
    return ("; ".join(problems) or None), not_applicable


def last_json(lines: list[str]) -> Any:
    """The last line of ``lines`` that parses as JSON (a step's machine-readable result), or None."""
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _bench_lines(bench: dict[str, Any]) -> list[str]:
    out = []
    for row in bench["rows"]:
        if "ours" not in row or not isinstance(row["ours"], float) or row["ours"] > 1e3:
            continue  # memory rows (bytes) and the loop: in the JSON
        peers = ", ".join(f"{k} {row[k] * 1e3:.1f} ms" for k in ("floor", "dcp", "dcp best staging") if k in row)
        out.append(f"  {row['row']}: ours {row['ours'] * 1e3:.1f} ms" + (f" ({peers})" if peers else ""))
    words = {True: "PASS", False: "MISS", None: "n/a"}
    return out + [f"  {words[t['met']]} {t['target']}: {t['detail']}" for t in bench.get("targets", [])]


def summary_lines(record: dict[str, Any]) -> list[str]:
    """The closing lines: each step's status and seconds, the tests' counts, the micro-check and the benchmark."""
    lines = [f"gpu-check {record['mode']}: {'OK' if record['ok'] else 'NOT OK'} in {record['seconds']} s (commit {record['commit']})"]
    lines += [f"  {s['name']}: {s['status']} in {s['seconds']} s" for s in record["steps"]]
    results = record["results"]
    for name in ("cuda tests", "suite"):
        if name in results:
            lines.append(f"  {name}: {results[name]['counts']}")
            lines += [f"    not applicable: {t}: {why}" for t, why in results[name].get("not applicable", {}).items()]
            lines += [f"    {t['outcome']}: {t['test']}: {t['message'][:200]}" for t in results[name]["tests"] if t["outcome"] in ("failed", "error")]
    for row in (results.get("d2h") or {}).get("rows", []):
        lines.append(f"  d2h into {row['memory']}: " + (f"FAILED: {row['error']}" if "error" in row else f"{row['GB/s']:.1f} GB/s"))
    if "benchmark" in results:
        lines += _bench_lines(results["benchmark"])
    return lines
