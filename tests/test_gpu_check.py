"""``.ci/gpu-check``, the one script a lent GPU machine runs, tried here before a GPU minute is spent on it.

On a device-like image (tests/_device_image.py: this interpreter with only the GPU image's packages, so neither
fairscale nor parameterized, s3fs, fairseq nor mkdocs), with what ``--prepare`` carried: every test file the
script selects is collected without an error, the CUDA tests among them, and without the carry collection fails
(so the image is honest). ``--prepare`` fails loudly when a package cannot be carried. The step runner bounds each
step, says which failed and reads pytest's results back; the GPU benchmark removes its checkpoints when ``timeout``
ends it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from _device_image import DeviceImage

from benchmarks.gpu import carry as carry_mod
from benchmarks.gpu import check
from benchmarks.gpu.check import cuda_test_files
from benchmarks.gpu.steps import Step, run_phase
from benchmarks.gpu.summary import judge_cuda_tests, junit_results, verbose_results

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu-check"
DEADLINE_S = 600
NEED_S3FS = {"tests/test_s3_infra.py", "tests/test_object_store_writers.py", "tests/test_store_deadline_dead.py"}  # skipped whole on the image, saying so
NEED_TWO_GPUS = [
    "tests/test_cuda_scatter.py::test_a_scatter_over_nccl_loads_each_rank_its_own_shard_on_its_gpu",
    "tests/test_object_transport.py::test_the_object_transport_gathers_from_two_gpus",
]
KNOWN_CUDA_TESTS = [  # CUDA tests on main when this test was written: each must stay selected
    "tests/test_stager.py::test_gpu_saves_and_loads_are_exact_and_load_into_the_live_state",
    "tests/test_demo.py::test_demo_on_one_gpu_trains_saves_and_resumes_there",
]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[DeviceImage, Path]:
    """The device-like image, and a carry made by ``--prepare`` here."""
    root = tmp_path_factory.mktemp("device")
    carried = root / "carry"
    done = subprocess.run(["bash", str(SCRIPT), "--prepare", str(carried)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return DeviceImage(root / "image"), carried


def _script(image: DeviceImage, carried: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = image.env(ROOT, None, GPU_CHECK_CARRY=str(carried), OUT=str(out))
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    report = out / "gpu-check.json"
    assert report.exists(), f"no {report}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done, json.loads(report.read_text())


def test_prepare_carries_both_packages_as_pure_python_folders(image: tuple[DeviceImage, Path]) -> None:
    _, carried = image
    for name in ("fairscale", "parameterized"):
        assert (carried / name / "__init__.py").is_file(), f"{name} not carried into {carried}"
    assert not list(carried.rglob("__pycache__")) and not list(carried.rglob("*.so")), "only sources travel"
    assert (carried / "COMMIT").read_text().strip(), "the carry records the commit it came from"


def test_device_like_image_lacks_what_the_gpu_machine_lacks(image: tuple[DeviceImage, Path]) -> None:
    device, carried = image
    probe = "import importlib.util as u; print([m for m in ('fairscale', 'parameterized', 's3fs', 'fairseq', 'mkdocs', 'torch') if u.find_spec(m)])"
    for carry, expected in ((None, ["torch"]), (carried, ["fairscale", "parameterized", "torch"])):
        done = subprocess.run([sys.executable, "-c", probe], env=device.env(ROOT, carry), capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == str(expected), f"carry {carry}: {done.stdout} {done.stderr}"


def test_prepare_fails_loudly_where_a_package_is_missing(image: tuple[DeviceImage, Path], tmp_path: Path) -> None:
    device, _ = image
    dest = tmp_path / "carry"
    done = subprocess.run(["bash", str(SCRIPT), "--prepare", str(dest)], env=device.env(ROOT, None), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, f"--prepare without fairscale exited {done.returncode}: {done.stdout} {done.stderr}"
    assert "gpu-check --prepare FAILED: fairscale is not importable here" in done.stderr, done.stderr
    assert not dest.exists(), "a failed --prepare wrote nothing"


@pytest.mark.parametrize(("names", "says"), [
    (("parameterized", "no_such_package_anywhere"), "no_such_package_anywhere is not importable here"),
    (("argparse",), "argparse is a single module"),
    (("xxhash",), "holds compiled files"),
])  # fmt: skip
def test_carry_refuses_what_cannot_travel_and_writes_nothing(tmp_path: Path, names: tuple[str, ...], says: str) -> None:
    dest = tmp_path / "carry"
    with pytest.raises(carry_mod.CarryError, match=says):
        carry_mod.carry(dest, names)
    assert not dest.exists(), "nothing written before every package was checked"


def test_device_like_image_collects_every_cuda_test_the_script_selects(image: tuple[DeviceImage, Path], tmp_path: Path) -> None:
    device, carried = image
    done, report = _script(device, carried, tmp_path / "out", "--collect")
    assert done.returncode == 0 and report["ok"], f"{[(s['name'], s['status'], s['tail'][-1500:]) for s in report['steps']]}"
    collected = report["results"]["collected"]["cuda tests"]
    assert set(KNOWN_CUDA_TESTS) <= set(collected), f"CUDA tests not selected: {set(KNOWN_CUDA_TESTS) - set(collected)}"
    assert {c.split("::")[0] for c in collected} <= set(cuda_test_files()), collected
    imports = next(s for s in report["steps"] if s["name"] == "imports")
    assert f"from {carried}/fairscale" in imports["tail"], imports["tail"]
    plan = report["results"]["cuda plan"]  # what a one-GPU machine runs: nothing there may skip but for a count
    assert plan["gpus"] == 1 and not plan["unexplained"], plan
    assert set(KNOWN_CUDA_TESTS) <= set(plan["runs"]) and set(plan["runs"]) | set(plan["not_applicable"]) == set(collected), plan
    assert set(NEED_TWO_GPUS) <= set(plan["not_applicable"]), plan
    assert all(why.startswith("needs 2 CUDA devices, this machine has 1") for why in plan["not_applicable"].values()), plan


SAMPLE_CUDA_TESTS = """
import pytest
@pytest.mark.skipif(True, reason="needs two CUDA devices: one rank per GPU")
def test_two(): pass
@pytest.mark.skipif(False, reason="needs a CUDA device: runs")
def test_one(): pass
@pytest.mark.skipif(False, reason="needs a CUDA device: skips from its body")
def test_skips_itself(): pytest.skip("no reason given")
"""


# The sample suite's files, spelt so that the suite's check of named paths does not look for them here.
SAMPLE, OTHER = "tests" + "/test_sample.py", "tests" + "/test_a.py"


def _sample_run(tmp_path: Path, gpus: int) -> tuple[dict, dict]:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("import _gpu_plan\ndef pytest_collection_finish(session):\n    _gpu_plan.write_plan(session.items)\n")
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE_CUDA_TESTS)
    env = os.environ | {"PYTHONPATH": str(ROOT / "tests"), "FSDP_OPTIM_GPU_PLAN": str(tmp_path / "plan.json"), "FSDP_OPTIM_GPUS": str(gpus)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={tmp_path / 'out.xml'}", "tests"],
                   cwd=tmp_path, env=env, capture_output=True, timeout=120)  # fmt: skip
    return junit_results(tmp_path / "out.xml", every=True), json.loads((tmp_path / "plan.json").read_text())


def test_a_cuda_test_needing_more_gpus_is_not_applicable_and_any_other_skip_fails_the_step(tmp_path: Path) -> None:
    found, plan = _sample_run(tmp_path, gpus=1)
    assert plan["runs"] == [SAMPLE + "::test_one"], plan
    assert plan["not_applicable"] == {SAMPLE + "::test_two": "needs 2 CUDA devices, this machine has 1: needs two CUDA devices: one rank per GPU"}, plan
    assert list(plan["unexplained"]) == [SAMPLE + "::test_skips_itself"], plan
    problem, not_applicable = judge_cuda_tests(found, plan)
    assert not_applicable == {"tests.test_sample::test_two": plan["not_applicable"][SAMPLE + "::test_two"]}, not_applicable
    assert problem is not None and "1 unexpected skips: tests.test_sample::test_skips_itself (no reason given)" in problem, problem
    assert "1 may skip for an unstated reason" in problem, problem
    del plan["unexplained"][SAMPLE + "::test_skips_itself"]
    found["tests"] = [t for t in found["tests"] if not t["test"].endswith("test_skips_itself")]
    assert judge_cuda_tests(found, plan) == (None, not_applicable), "a skip for too few GPUs alone: the step passes"


def test_on_a_machine_with_enough_gpus_the_multi_gpu_tests_are_planned_to_run(tmp_path: Path) -> None:
    _, plan = _sample_run(tmp_path, gpus=2)
    assert sorted(plan["runs"]) == [SAMPLE + "::test_one", SAMPLE + "::test_two"] and not plan["not_applicable"], plan


def test_prepare_uses_the_interpreter_that_runs_the_tests_not_the_first_python3(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").write_text("#!/bin/sh\nexec /usr/bin/env -i /bin/sh -c 'exit 1'\n")  # a python3 without the extra
    (bare / "python3").chmod(0o755)
    env = os.environ | {"PATH": f"{bare}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(SCRIPT), "--prepare", str(tmp_path / "carry")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "carry" / "fairscale" / "__init__.py").is_file(), "carried by the interpreter that has fairscale"


def test_the_default_run_fits_180_s_and_the_suite_8_minutes_with_a_result_per_test() -> None:
    script = SCRIPT.read_text()
    assert check.CHECKS_BUDGET_S <= 180 - 5 and "bound=190" in script, "the runner's budget, then its cleanup's bound"
    assert check.SUITE_BUDGET_S <= 480 - 10 and "bound=490" in script, "--suite has its own budget"
    with tempfile.TemporaryDirectory() as name:
        suite = check.suite_phases(Path(name), collect=False)[-1][0]
    assert suite.timeout_s < check.SUITE_BUDGET_S and suite.stop_signal == "INT" and "-v" in suite.argv, suite
    lines = [f"[gw1] [ 50%] PASSED {OTHER}::test_b", f"[gw0] [100%] FAILED {OTHER}::C::test_d[x]"]
    assert verbose_results(lines)["tests"] == [
        {"test": "tests.test_a::test_b", "outcome": "passed", "seconds": None, "message": ""},
        {"test": "tests.test_a.C::test_d[x]", "outcome": "failed", "seconds": None, "message": ""}], "a result per test"


def test_a_pytest_step_ended_by_its_bound_still_writes_the_tests_that_ended(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text("import time\ndef test_quick(): pass\ndef test_sleeps(): time.sleep(60)\n")
    xml = tmp_path / "out.xml"
    # --rootdir: the test names in the XML are relative to it, wherever the checkout running this lies (under /tmp too)
    step = Step("tests", (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--rootdir={tmp_path}", f"--junitxml={xml}", str(tmp_path / "test_slow.py")),
                8, stop_signal="INT")  # fmt: skip
    with open(tmp_path / "log", "w") as log:
        outcomes = run_phase([step], tmp_path, log, left_s=100)
    assert outcomes["tests"]["status"] == "timed out", outcomes["tests"]
    tests = junit_results(xml, every=True)["tests"]
    assert {"test": "test_slow::test_quick", "outcome": "passed"}.items() <= tests[0].items(), tests


def test_device_like_image_collects_the_whole_suite_without_an_error(image: tuple[DeviceImage, Path], tmp_path: Path) -> None:
    device, carried = image
    done, report = _script(device, carried, tmp_path / "out", "--collect", "--suite")
    suite = next(s for s in report["steps"] if s["name"] == "suite")
    assert done.returncode == 0 and suite["status"] == "passed", suite["tail"][-3000:]
    files = {c.split("::")[0] for c in report["results"]["collected"]["suite"]}
    every = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    assert every - files == NEED_S3FS, f"collected no test of {every - files - NEED_S3FS}, or of none of {NEED_S3FS - (every - files)}"
    said = sum(int(n) for n in re.findall(r"SKIPPED \[(\d+)\] .*which this machine lacks", suite["tail"]))  # pytest groups one reason
    assert said == len(NEED_S3FS), f"each says why it is skipped: {suite['tail'][-2000:]}"
    _, without = _script(device, tmp_path / "nothing-carried", tmp_path / "out2", "--collect")
    assert not without["ok"], "without the carry the image cannot import fairscale: the collection must fail"


@pytest.mark.parametrize("skip", [False, True])
def test_a_missing_test_extra_fails_here_and_skips_on_the_image_saying_why(image: tuple[DeviceImage, Path], skip: bool) -> None:
    device, carried = image
    env = device.env(ROOT, carried, **({"FSDP_OPTIM_MISSING_EXTRAS": "skip"} if skip else {}))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_s3_infra.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
    if skip:
        assert done.returncode == 5 and "needs s3fs and botocore (No module named 's3fs'), which this machine lacks" in done.stdout, done.stdout[-2000:]
    else:
        assert done.returncode == 2 and "needs s3fs and botocore (No module named 's3fs'): install the test extra" in done.stdout, done.stdout[-2000:]


def test_steps_are_bounded_and_each_says_how_it_ended(tmp_path: Path) -> None:
    steps = [
        Step("ok", (sys.executable, "-c", "print('fsdp_optim demo on the CPU (gloo): ok')"), 30, expect="fsdp_optim demo on the CPU"),
        Step("wrong line", (sys.executable, "-c", "print('something else')"), 30, expect="fsdp_optim demo on GPUs"),
        Step("fails", (sys.executable, "-c", "raise SystemExit(3)"), 30),
        Step("hangs", (sys.executable, "-c", "import time; print('going', flush=True); time.sleep(60)"), 2),
    ]
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        outcomes = run_phase(steps, tmp_path, log, left_s=100)
    assert time.monotonic() - start < 30, "the hanging step was ended at its bound"
    statuses = {name: o["status"] for name, o in outcomes.items()}
    assert statuses == {"ok": "passed", "wrong line": "failed: no line starting 'fsdp_optim demo on GPUs'", "fails": "failed",
                        "hangs": "timed out"}, statuses  # fmt: skip
    assert outcomes["hangs"]["tail"] == "going" and outcomes["fails"]["rc"] == 3, outcomes
    assert outcomes["ok"]["seconds"] < outcomes["hangs"]["seconds"], "each step's own seconds, not its phase's"
    assert "[ok] fsdp_optim demo" in (tmp_path / "log").read_text(), "every step's output goes into the run's log"


def test_a_terminated_run_still_writes_its_json_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "GPU_CHECK_CARRY": str(tmp_path / "none")}
    proc = subprocess.Popen(["bash", str(SCRIPT), "--collect"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None, "a pipe"
        for line in proc.stdout:  # the first step has started: its process is running
            if line.startswith("[imports] started"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, f"exit {proc.returncode}: {rest[-2000:]}"
    report = json.loads((out / "gpu-check.json").read_text())
    assert not report["ok"] and report["interrupted"] == "signal 15", report
    assert {s["name"]: s["status"] for s in report["steps"]} == {"imports": "not run", "cuda tests": "not run"}, report["steps"]


def test_junit_results_count_outcomes_and_keep_skip_reasons(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs a CUDA device')\n"
        "def test_skipped(): pass\n"
    )
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(tmp_path / "test_sample.py")],
                   capture_output=True, cwd=tmp_path, timeout=120)  # fmt: skip
    found = junit_results(xml, every=False)
    assert found["counts"] == {"passed": 1, "failed": 1, "skipped": 1}, found
    assert found["skip_reasons"] == {"needs a CUDA device": 1}, found
    assert [t["test"].split("::")[-1] for t in found["tests"]] == ["test_fails"] and "one is not two" in found["tests"][0]["message"], found


def test_gpu_benchmark_removes_its_checkpoints_when_timeout_ends_it(tmp_path: Path) -> None:
    directory = tmp_path / "bench"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "benchmarks.gpu", "--small", "--repeats", "1", "--dir", str(directory), "--out", str(tmp_path)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        stop_at = time.monotonic() + DEADLINE_S
        while not (directory / "ours").exists():  # a checkpoint is being written
            assert proc.poll() is None and time.monotonic() < stop_at, f"the benchmark ended before it wrote: {proc.returncode}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, f"exit {proc.returncode}: {output[-2000:]}"
    assert not directory.exists(), f"left behind: {list(directory.rglob('*'))[:5]}"
    assert "floors:" in output, f"progress lines reach the output as they come: {output[-2000:]}"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (what gpu-check measures there)")


@CUDA
def test_d2h_measures_each_kind_of_host_memory() -> None:
    from benchmarks.gpu import d2h

    rows = d2h.measure(64 << 20, 2)
    assert [r["memory"] for r in rows] == ["registered", "pinned", "pageable"], rows
    assert all("error" not in r and r["GB/s"] > 0 for r in rows), rows
    assert rows[0]["register_s"] is not None and rows[1]["register_s"] is None, rows


def _nccl_rows(rank: int, world_size: int, directory: str) -> dict[str, float]:  # noqa: ARG001
    from benchmarks.gpu import rows
    from benchmarks.gpu.models import Config

    config = Config(2, 256, 8, torch.device("cuda", 0), directory, repeats=1)
    return rows.nccl_blocking(config).medians()


@CUDA
def test_gpu_benchmark_measures_the_blocking_part_on_an_nccl_group(tmp_path: Path) -> None:
    from _dist import run_ranks

    from benchmarks.gpu.rows import NCCL_BLOCKING, NCCL_IDLE

    (medians,) = run_ranks(_nccl_rows, 1, str(tmp_path), backend="nccl")
    assert set(medians) == {NCCL_BLOCKING, NCCL_IDLE} and all(v > 0 for v in medians.values()), medians
    assert not (tmp_path / "ours-nccl").exists(), "the row's checkpoints are removed once it is measured"


LOOP_FIELDS = ("step clock", "step, no save", "step, save in flight", "worst step, save in flight", "slowdown", "worst slowdown",
               "dcp: step, no save", "dcp: step, save in flight", "dcp: worst step, save in flight", "dcp: slowdown", "dcp: worst slowdown")  # fmt: skip
MEMORY_ROWS = ("async save, whole: host RSS", "sync save: GPU memory", "load: GPU memory", "async save, whole: GPU memory")


def test_the_small_benchmark_writes_every_field_a_user_compares_with_cpu_stand_ins(tmp_path: Path) -> None:
    """DCP's step slowdown beside ours, measured the same way; per-step median and worst step while a save is in
    flight; the host RSS growth over the whole async save; the GPU memory growth of save and load (on the CPU, the
    host's, said in the meta)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--small", "--repeats", "1", "--dir", str(tmp_path / "bench"), "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    stored = json.loads((tmp_path / "gpu_staging_small.json").read_text())
    at = {r["row"]: r for r in stored["rows"]}
    loop = next(r for name, r in at.items() if name.startswith("training loop"))
    assert not [k for k in LOOP_FIELDS if k not in loop], f"the loop lacks {[k for k in LOOP_FIELDS if k not in loop]}: {loop}"
    assert not [r for r in MEMORY_ROWS if "ours" not in at.get(r, {})], f"rows missing: {[r for r in MEMORY_ROWS if r not in at]}"
    assert "dcp" in at["async save, whole: host RSS"], at["async save, whole: host RSS"]
    assert "host RSS growth" in stored["meta"]["stand-ins"] and loop["step clock"].startswith("host clock"), stored["meta"]
    names = [t["target"] for t in stored["targets"]]
    assert "GPU memory growth of a load <= a ring slot + 64 MiB (96 MiB)" in names, names
