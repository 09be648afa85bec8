"""Offline verbs run by many processes (``fsdp_optim/offline/parallel``): the split is balanced and contiguous, the
result of a reshard by 2 processes (spawned on a real gloo group, or real ``torchrun`` processes, on one "node" or
two) is byte for byte what one process writes but for the save id, and a failure or a SIGKILL on any process fails
every process, commits nothing, touches no foreign file, and a rerun starts clean."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _dist import free_port, run_ranks
from test_recut_blocks import _full, _layout

import fsdp_optim
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.split import split_by_bytes, split_stream
from fsdp_optim.offline.verify import verify

ROOT = Path(__file__).resolve().parent.parent
_SAVE_ID = re.compile(r"[0-9a-f]{32}|[0-9a-f]{12}")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of six units (two dtypes, one unit not sharded, one empty) at world size 2."""
    src = tmp_path_factory.mktemp("parallel") / "src"
    fsdp_optim.reshard(_full(_layout(4)), 2, src, layout=_layout(4))
    return src


def test_split_is_contiguous_and_balanced() -> None:
    split = split_by_bytes([4, 4, 4], 2)
    assert split.runs == ((0,), (1, 2)), split
    for sizes, processes in [([10] * 992, 64), ([10] * 1024, 512), ([5, 1, 7, 0, 3, 3, 9], 3), ([0, 0, 0], 2)]:
        split = split_by_bytes(sizes, processes)
        flat = [i for run in split.runs for i in run]
        assert flat == list(range(len(sizes))), f"every output once, in order: {split.runs}"
        mean = sum(sizes) / processes
        assert all(abs(n - mean) <= max(sizes) for n in split.nbytes), f"off by more than one output: {split.nbytes}"
    assert split_by_bytes([10] * 1024, 512).spread() == 0.0, "1024 equal files over 512 processes: 2 each"
    with pytest.raises(ValueError, match="processes: expected at least 1"):
        split_by_bytes([1], 0)


def _big_layout(world_size: int) -> ModelLayout:
    """Six units as ``_layout``'s (one empty, one not sharded, one of float64) but large enough that a rank file
    holds many 64 KiB chunks: a share can end inside a file, a tensor and a shard."""
    import torch

    sizes = [(300_001, torch.float32, True), (5, torch.float32, True), (0, torch.float32, True),
             (70_000, torch.float64, True), (9_000, torch.float32, False), (130_001, torch.float32, True)]  # fmt: skip
    flats, names = [], []
    for u, (numel, dtype, sharded) in enumerate(sizes):
        w, b = ParamSpec(f"u{u}.w", (numel,), 0), ParamSpec(f"u{u}.b", (3,), numel)
        flats.append(FlatParamLayout(f"u{u}", (w, b), world_size if sharded else 1, 0, dtype, True))
        names += [w.name, b.name]
    return ModelLayout(tuple(flats), tuple(names), world_size, 0)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``_big_layout``'s checkpoint at world size 2 (~3.5 MiB of state)."""
    src = tmp_path_factory.mktemp("parallel_big") / "src"
    fsdp_optim.reshard(_full(_big_layout(4)), 2, src, layout=_big_layout(4))
    return src


def test_stream_split_cuts_on_chunks_and_balances() -> None:
    """Equal shares of all the files' bytes, cut only on a chunk boundary or a tensor's end, each byte once; the
    owner of a file holds its first byte."""
    tensors = [(1_000_000, 65536), (4, 65536), (300_000, 65536)]
    d = sum(n for n, _ in tensors)
    bounds = {0, d} | {b + k for b, (n, c) in zip([0, 1_000_000, 1_000_004], tensors) for k in range(0, n, c)}
    for outputs, processes in [(3, 2), (1, 2), (7, 4), (992, 512), (992, 64), (2, 5)]:
        split = split_stream(outputs, tensors, processes)
        covered = [(s.output, s.start, s.stop) for p in range(processes) for s in split.stretches(p)]
        assert sum(b - a for _, a, b in covered) == outputs * d, f"every byte once: {covered[:4]}"
        assert covered == sorted(covered), "in order, no overlap"
        assert all(a in bounds and b in bounds for _, a, b in covered), f"cut inside a chunk: {covered}"
        assert all(abs(n - outputs * d / processes) <= 65536 for n in split.nbytes), split.nbytes
        owners = [p for p in range(processes) for _ in split.owned(p)]
        assert [o for p in range(processes) for o in split.owned(p)] == list(range(outputs)), "each owned once"
        assert all(any(s.output == o and s.start == 0 for s in split.stretches(owners[o])) for o in range(outputs)), owners
    metaseq = split_stream(992, [(2_822_000_000, 65536), (1_000_000, 65536)], 512)
    assert metaseq.spread() < 0.0001, f"992 files of 2.8 GB over 512 processes: {metaseq.spread()}"
    with pytest.raises(ValueError, match="processes: expected at least 1"):
        split_stream(3, tensors, 0)


def _rank_file(path: Path) -> tuple[list[str], dict[str, Any], bytes]:
    """A rank file's header keys in order, its header with the save id blanked, and its data."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["save_id"] = "-"
    return list(header), header, raw[8 + n :]


def assert_same_but_save_id(a: Path, b: Path) -> None:
    """The checkpoints in ``a`` and ``b`` hold the same file names (but the save id), headers (key order included)
    and tensor bytes, and the same manifest but the save id and the digests that cover it."""
    names_a, names_b = sorted(os.listdir(a)), sorted(os.listdir(b))
    assert [_SAVE_ID.sub("-", n) for n in names_a] == [_SAVE_ID.sub("-", n) for n in names_b], (names_a, names_b)
    for x, y in zip(names_a, names_b):
        if x.endswith(".safetensors"):
            assert _rank_file(a / x) == _rank_file(b / y), f"{x} and {y} differ beyond the save id"
    ma, mb = (json.loads((d / "manifest.json").read_text())["body"] for d in (a, b))
    for m in (ma, mb):
        m["save_id"] = "-"
        for files in (m, *([m["training"]] if m.get("training") else [])):
            files["files"] = [{**f, "file": _SAVE_ID.sub("-", f["file"]), "checksum": "-"} for f in files["files"]]
    assert ma == mb, "the manifests differ beyond the save id"
    assert verify(b).ok, f"{b} does not verify"


def _reshard_in_ranks(rank: int, world_size: int, src: str, out: str, new_world_size: int) -> str:  # noqa: ARG001
    return str(fsdp_optim.reshard(src, new_world_size, out, parallel=True))


@pytest.mark.parametrize("new_world_size", [3, 5])
def test_two_processes_write_what_one_writes(source: Path, tmp_path: Path, new_world_size: int) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    fsdp_optim.reshard(source, new_world_size, one)
    results = run_ranks(_reshard_in_ranks, 2, str(source), str(two), new_world_size, deadline_s=180)
    assert results == [str(two / "manifest.json")] * 2, results
    assert_same_but_save_id(one, two)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging directory or lock is left"


@pytest.mark.parametrize("new_world_size", [1, 3])
def test_two_processes_write_inside_one_file(big: Path, tmp_path: Path, new_world_size: int) -> None:
    """A file written by both processes (each its bytes at their offsets, its chunks' digests into their header
    slots): the bytes one process writes; each process's share within a chunk of half."""
    from fsdp_optim.formats.sharded.reader import open_checkpoint
    from fsdp_optim.offline.parallel.reshard import plan_reshard, share_spans

    with open_checkpoint(big) as ckpt:
        planned = plan_reshard(ckpt, new_world_size, "0" * 32, 2, "refuse")
        shares = [planned.split.stretches(p) for p in range(2)]
        read = [sum(s.stop - s.start for s in share_spans(ckpt, planned, planned.share(p))) for p in range(2)]
        alone = plan_reshard(ckpt, new_world_size, "0" * 32, 1, "refuse")
        once = sum(s.stop - s.start for s in share_spans(ckpt, alone, alone.share(0)))
    assert shares[0][-1].output == shares[1][0].output and shares[1][0].start > 0, f"a file split: {shares}"
    assert abs(planned.split.nbytes[0] - planned.split.nbytes[1]) <= 2 * 65536, planned.split.nbytes
    headers = 2 * 8192  # both processes read both source files' headers
    shared = 6 * 2 * 65536  # at most one source chunk per (unit, state key), where the two shares meet
    assert sum(read) <= once + headers + shared, f"each source byte read once but where shares meet: {read}, {once}"
    one, two = tmp_path / "one", tmp_path / "two"
    fsdp_optim.reshard(big, new_world_size, one)
    results = run_ranks(_reshard_in_ranks, 2, str(big), str(two), new_world_size, deadline_s=180)
    assert results == [str(two / "manifest.json")] * 2, results
    assert_same_but_save_id(one, two)


def test_a_laid_out_file_filled_in_any_order_is_the_one_written_whole(big: Path, tmp_path: Path) -> None:
    """Three shares' runs written into laid-out files last share first: each file is byte for byte the one
    one process writes, and its record the same; a file with one run left unwritten is refused."""
    from fsdp_optim.core.dtypes import dtype_from_str
    from fsdp_optim.formats.sharded.ranged import finished_record, laid_out, lay_out_file, write_rank
    from fsdp_optim.formats.sharded.reader import open_checkpoint
    from fsdp_optim.formats.sharded.streamed import streamed_parts
    from fsdp_optim.formats.sharded.writer import write_shard_file
    from fsdp_optim.offline.parallel.reshard import plan_reshard
    from fsdp_optim.offline.parallel.stretches import cut_piece

    whole, ranged, torn = (tmp_path / n for n in ("whole", "ranged", "torn"))
    for d in (whole, ranged, torn):
        d.mkdir()
    with open_checkpoint(big) as ckpt:
        planned = plan_reshard(ckpt, 2, "ab" * 16, 3, "refuse")
        layouts = [laid_out(planned.final, r) for r in range(2)]
        for d in (ranged, torn):
            for layout in layouts:
                lay_out_file(d / layout.name, layout)
        runs = [run for p in (2, 1, 0) for run in planned.share(p)]
        assert len({run.rank for run in planned.share(1)}) == 2, "process 1's share crosses both files"
        for k, run in enumerate(runs):
            read, dtype = planned.plan.source.reader(run.rank), dtype_from_str(run.name, where="test")
            pieces = [cut_piece(planned.plan, run.rank, piece, dtype, read) for piece in run.pieces]
            for d in (ranged, torn) if k != len(runs) // 2 else (ranged,):
                write_rank(d / layouts[run.rank].name, layouts[run.rank], {run.name: pieces},
                           span=(run.tensor, run.start, run.stop), after=lambda n: None)
        final = planned.final
        records = [write_shard_file(whole, streamed_parts(planned.plan, final, r, after_shard=lambda: None),
                                    save_id=final.save_id, rank=r, world_size=2, staged=True) for r in range(2)]
    for layout, record in zip(layouts, records):
        assert (ranged / layout.name).read_bytes() == (whole / record.file).read_bytes(), f"{layout.name} differs"
        assert finished_record(ranged / layout.name, layout) == record, "the same record"
    missed = layouts[runs[len(runs) // 2].rank]
    with pytest.raises(ValueError, match="placeholder is left"):
        finished_record(torn / missed.name, missed)


def _reshard_full_in_ranks(rank: int, world_size: int, full: str, layout: str, out: str) -> str:  # noqa: ARG001
    return str(fsdp_optim.reshard(full, 3, out, layout=layout, parallel=True))


def test_a_full_dict_is_resharded_by_process_0_alone(source: Path, tmp_path: Path) -> None:
    """A source with no split of its own (a full dict file): process 0 writes it, the other waits, both return."""
    import torch

    full = tmp_path / "full.pt"
    torch.save(_full(_layout(4)), full)
    fsdp_optim.reshard(full, 3, tmp_path / "one", layout=source)
    results = run_ranks(_reshard_full_in_ranks, 2, str(full), str(source), str(tmp_path / "two"), deadline_s=180)
    assert results == [str(tmp_path / "two" / "manifest.json")] * 2, results
    assert_same_but_save_id(tmp_path / "one", tmp_path / "two")


def test_split_or_alone_is_decided_by_one_rule(source: Path, tmp_path: Path) -> None:
    """``splits``: the one rule the CLI under torchrun and the API's ``parallel=True`` both ask."""
    import torch

    from fsdp_optim.offline.parallel.entry import splits

    full = tmp_path / "full.pt"
    torch.save(_full(_layout(4)), full)
    out = tmp_path / "out"
    assert splits("reshard", source, output=out), "our sharded checkpoint into a local directory: split"
    assert not splits("reshard", full, output=out), "a full dict: process 0 alone"
    assert not splits("reshard", _full(_layout(4)), output=out), "a dict in memory: process 0 alone"
    assert splits("consolidate", source, output=tmp_path / "m.safetensors"), "one safetensors file: split"
    assert not splits("consolidate", source, output=tmp_path / "full.pt"), "a full dict file: process 0 alone"
    assert splits("verify", source) and not splits("verify", full), "verify splits our sharded checkpoint only"
    assert splits("diff", source, source) and not splits("diff", source, full), "diff splits what reads by ranges"
    assert not splits("convert", source, output=out), "a verb with no split of its own"


def test_two_one_process_reshards_differ_only_in_the_save_id(source: Path, tmp_path: Path) -> None:
    fsdp_optim.reshard(source, 3, tmp_path / "a")
    fsdp_optim.reshard(source, 3, tmp_path / "b")
    assert_same_but_save_id(tmp_path / "a", tmp_path / "b")


def test_parallel_needs_a_team(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="parallel: expected a process group of 2 or more processes"):
        fsdp_optim.reshard(source, 3, tmp_path / "out", parallel=True)
    assert not (tmp_path / "out").exists(), "nothing written"


# A process of the CLI that fails (or is killed) right after it has written its first run of chunks.
_FAILING = """
import os, signal, sys
import fsdp_optim.offline.parallel.reshard as R
real = R.write_rank
def failing(path, *args, **kwargs):
    real(path, *args, **kwargs)
    if sys.argv[1] in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if sys.argv[1] == "kill" else signal.SIGSTOP)
    raise OSError(f"disk full (injected) after {path.name}")
R.write_rank = failing
from fsdp_optim.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _launch(rank: int, port: int, argv: list[str], failing: str | None) -> subprocess.Popen[str]:
    """Process ``rank`` of 2 as ``torchrun`` would start it (its environment), running ``fsdp-optim argv``."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}  # fmt: skip
    cmd = [sys.executable, "-c", _FAILING, failing, *argv] if failing else [sys.executable, "-m", "fsdp_optim", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_pair(argv: list[str], failing: dict[int, str]) -> list[tuple[int, str, float]]:
    """Both processes to the end (each killed at 240 s): ``(exit code, stderr, seconds)`` each."""
    port = free_port()
    start = time.monotonic()
    procs = [_launch(r, port, argv, failing.get(r)) for r in range(2)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, 240 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err, time.monotonic() - start))
    return out


@pytest.mark.parametrize(
    ("victim", "how", "kind"),
    [(1, "kill", "source"), (1, "kill", "big"), pytest.param(1, "error", "source", marks=pytest.mark.slow),
     pytest.param(0, "kill", "big", marks=pytest.mark.slow)],
)
def test_a_failure_anywhere_fails_all_and_commits_nothing(
    request: pytest.FixtureRequest, tmp_path: Path, victim: int, how: str, kind: str
) -> None:
    """``kind`` "big": the victim dies after its first run of chunks, in a file the other process writes too."""
    source = request.getfixturevalue(kind)
    out = tmp_path / "out"
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not ours")
    argv = ["reshard", str(source), "--world-size", "3", "-o", str(out)]
    results = _run_pair(argv, {victim: how})
    other = results[1 - victim]
    assert results[victim][0] == (-signal.SIGKILL if how == "kill" else 1), results[victim]
    assert other[0] == 1, f"the other process must fail: {other}"
    assert "fsdp-optim: error:" in other[1], other[1]
    if how == "error":
        assert "disk full (injected)" in other[1] and "raised on rank 1" in other[1], other[1]
    assert other[2] < 120, f"the other process took {other[2]:.0f} s to fail"
    assert not (out / "manifest.json").exists(), "nothing committed"
    assert foreign.read_text() == "not ours", "a foreign file was touched"
    if victim != 0:  # process 0 lived: it undid everything itself
        assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], list(tmp_path.iterdir())
    again = _run_pair(argv, {})
    assert [code for code, _, _ in again] == [0, 0], again
    one = tmp_path / "one"
    fsdp_optim.reshard(source, 3, one)
    assert_same_but_save_id(one, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "one", "out"], "a rerun leaves nothing else"


@pytest.mark.slow
def test_a_process_that_stops_answering_fails_the_others(source: Path, tmp_path: Path) -> None:
    """Process 1 stopped (SIGSTOP) after its first file: process 0's watch round times out and it fails, commits
    nothing, and undoes its output, within the team's timeout (30 s) and a round."""
    out = tmp_path / "out"
    port = free_port()
    argv = ["reshard", str(source), "--world-size", "3", "-o", str(out)]
    first, stopped = _launch(0, port, argv, None), _launch(1, port, argv, "stop")
    try:
        _, err = first.communicate(timeout=180)
    finally:
        stopped.kill()
        stopped.communicate()
    assert first.returncode == 1 and "lost contact with another process" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "process 0 undid everything"


def _torchrun(argv: list[str], *, nnodes: int = 1, node_rank: int = 0, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "fsdp_optim", *argv]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_torchrun_two_processes(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _torchrun(["reshard", str(source), "--world-size", "3", "-o", str(out)], port=free_port())
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    assert stdout.splitlines() == [f"wrote {out}: 3 rank files, 4.1 KiB (4224 B)"], stdout
    fsdp_optim.reshard(source, 3, tmp_path / "one")
    assert_same_but_save_id(tmp_path / "one", out)


def test_torchrun_two_nodes_of_two(big: Path, tmp_path: Path) -> None:
    """Two "nodes" on loopback (a static master), 4 processes, 3 output ranks: files written by processes of both
    nodes."""
    out, port = tmp_path / "out", free_port()
    argv = ["reshard", str(big), "--world-size", "3", "-o", str(out)]
    nodes = [_torchrun(argv, nnodes=2, node_rank=n, port=port) for n in range(2)]
    outputs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err for _, err in outputs]
    fsdp_optim.reshard(big, 3, tmp_path / "one")
    assert_same_but_save_id(tmp_path / "one", out)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole checkpoint (weights, buffers, optimizer, extra) saved by 2 real fairscale ranks."""
    from test_whole_state import _save

    out = tmp_path_factory.mktemp("whole") / "step3"
    run_ranks(_save, 2, str(out), False)
    return out


def test_whole_checkpoint_by_two_processes(whole: Path, tmp_path: Path) -> None:
    """Weights ride with the optimizer's keys and process 0 carries the side files: the same bytes as one process,
    whose two runs differ in the save id alone, side files included."""
    fsdp_optim.reshard(whole, 3, tmp_path / "a")
    fsdp_optim.reshard(whole, 3, tmp_path / "b")
    assert_same_but_save_id(tmp_path / "a", tmp_path / "b")
    run_ranks(_reshard_in_ranks, 2, str(whole), str(tmp_path / "two"), 3, deadline_s=180)
    assert_same_but_save_id(tmp_path / "a", tmp_path / "two")
    assert any(n.startswith("train-") for n in os.listdir(tmp_path / "two")), "the side files were carried"


def _watched(rank: int, world_size: int) -> tuple[int, str]:
    """Each process reports 1,000 + rank bytes done, then finishes; process 0 draws the bar."""
    import io
    import sys

    from fsdp_optim.job.team import team_of_job

    team = team_of_job()
    assert team is not None, "a team of 2"
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        watch = team.progress(2001, bar=True)
        watch.advance(1000 + rank)
        watch.finish(None)
        return watch.everyone, sys.stderr.getvalue()
    finally:
        sys.stderr = err


def test_the_watch_counts_every_process_bytes() -> None:
    (total0, bar0), (total1, bar1) = run_ranks(_watched, 2, deadline_s=120)
    assert total0 == total1 == 2001, (total0, total1)
    assert "2 processes: 100%" in bar0 and "1.95k/1.95k" in bar0, f"process 0's bar (2001 B in KiB): {bar0!r}"
    assert bar1 == "", f"only process 0 draws a bar: {bar1!r}"


def test_a_command_run_by_a_rank_runs_alone(source: Path) -> None:
    """A training job's rank that runs ``fsdp-optim`` as a command passes RANK and WORLD_SIZE on: the command must not
    try to join the job's group (it would wait for the other ranks), it runs alone."""
    inner = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-m', 'fsdp_optim', 'verify', {str(source)!r}]).returncode)"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", inner], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_benchmark_page_renders_from_its_json() -> None:
    """benchmarks/results/offline_parallel.md is what its JSON renders, verdicts included."""
    if str(ROOT) not in sys.path[:1]:
        sys.path.insert(0, str(ROOT))  # fairscale's wheel installs a top-level ``benchmarks`` too
    from benchmarks.offline_parallel.render import markdown, targets

    stored = json.loads((ROOT / "benchmarks" / "results" / "offline_parallel.json").read_text())
    assert targets(stored) == stored["targets"], "the verdicts differ from the stored ones"
    assert markdown(stored) == (ROOT / "benchmarks" / "results" / "offline_parallel.md").read_text(), "page differs"


def _verify_in_ranks(rank: int, world_size: int, path: str) -> list[str]:  # noqa: ARG001
    return verify(path, parallel=True).lines()


def test_verify_by_two_processes_reports_what_one_does(source: Path, tmp_path: Path) -> None:
    """Each process checks its share of the files; the report, a damaged file included, is one process's."""
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    victim = sorted(damaged.glob("optim-*rank00001*"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF  # a byte of state, past the header
    victim.write_bytes(bytes(raw))
    for path in (source, damaged):
        one = verify(path).lines()
        both = run_ranks(_verify_in_ranks, 2, str(path), deadline_s=180)
        assert both == [one, one], (both, one)
    assert not verify(damaged).ok and "rank00001" in " ".join(verify(damaged).damaged()), "the damage is reported"


def test_cli_verify_by_two_processes_prints_once(source: Path) -> None:
    port = free_port()
    procs = [_launch(r, port, ["verify", str(source)], None) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    one = subprocess.run([sys.executable, "-m", "fsdp_optim", "verify", str(source)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)  # fmt: skip
    assert outs[0][0] == one.stdout and outs[1][0] == "", outs


def test_cli_consolidate_by_two_processes_runs_on_process_0(source: Path, tmp_path: Path) -> None:
    """A verb with no split (consolidate): process 0 writes the file one process writes, process 1 prints nothing;
    an error there is every process's exit 1."""
    import torch

    out = tmp_path / "full.pt"
    port = free_port()
    procs = [_launch(r, port, ["consolidate", str(source), "-o", str(out)], None) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert outs[0][0].startswith(f"wrote {out}") and outs[1][0] == "", outs
    full = torch.load(out, weights_only=True)
    assert sorted(full["state"]) == sorted(fsdp_optim.consolidate(source)["state"]), "the full dict"
    port = free_port()
    again = [_launch(r, port, ["consolidate", str(source), "-o", str(out)], None) for r in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in again]
    assert [p.returncode for p in again] == [1, 1] and "exists already" in errs[0], errs
    assert "exists already" not in errs[1], f"process 0 alone says why: {errs}"
