"""``consolidate SRC -o s3://bucket/x/model.safetensors``: the one safetensors file written as the parts of ONE
multipart upload (``offline/onefile.py``, ``offline/onefile_parts.py``, ``disk/multipart.py``), against the
real SeaweedFS server of ``tests/_s3.py``: the object equals the file one process writes locally, byte for byte,
by one process and by two; a killed process leaves no object and no unfinished upload; a store without multipart
uploads gets the local file uploaded whole."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_optim
from fsdp_optim.cli import main
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.split import MIN_PART_BYTES, plan_parts, split_by_bytes
from fsdp_optim.formats.fullstate import FORMAT_KEY, FORMAT_VERSION

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

# A process of the CLI under a torchrun-like environment; "kill" kills itself (SIGKILL) once it has made its last
# tensor (its parts put).
_PROCESS = """
import os, signal, sys
import fsdp_optim.offline.onefile_parts as U
real = U.write_parts
def killed(layout, plan, rank, upload, upload_id, *, after):
    left = [len(plan.runs[rank])]
    def then(nbytes):
        after(nbytes)
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(layout, plan, rank, upload, upload_id, after=then)
if sys.argv[1] == "kill":
    U.write_parts = killed
from fsdp_optim.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(autouse=True)
def _fresh_s3_clients() -> Any:
    """s3fs clients made anew around each test: fsspec caches a filesystem by its arguments, not by the endpoint the
    environment names, and the tests here point the environment at the server or at the fault proxy."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_parts_tile_the_file_and_only_the_last_is_short() -> None:
    """Random layouts and splits: the parts tile ``[0, size)`` in number order, every part but the last is at least
    the minimum, process 0's first part starts at 0, and every tensor is written by exactly one process."""
    rng = random.Random(0)
    for _ in range(300):
        nbytes = [rng.choice([0, 1, MiB, 3 * MiB, 7 * MiB, 40 * MiB]) for _ in range(rng.randint(0, 12))]
        header = rng.randint(8, 2 * MiB)
        offsets = [header + sum(nbytes[:i]) for i in range(len(nbytes))]
        size = header + sum(nbytes)
        processes = rng.randint(1, 5)
        runs = split_by_bytes(nbytes, processes).runs
        plan = plan_parts(offsets, nbytes, size, runs, part_bytes=rng.choice([10 * MiB, 16 * MiB]))
        spans = sorted((s for p in plan.parts for s in p), key=lambda s: s.number)
        assert [s.number for s in spans] == list(range(1, len(spans) + 1)), f"numbers {spans}"
        assert spans[0].start == 0 and spans[-1].stop == size, f"the ends: {spans}"
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:])), f"gaps or overlaps: {spans}"
        assert all(s.stop - s.start >= MIN_PART_BYTES for s in spans[:-1]), f"a short part not last: {spans}"
        assert plan.parts[0][0].start == 0, "process 0 holds the header's room"
        assert sorted(i for run in plan.runs for i in run) == list(range(len(nbytes))), f"tensors: {plan.runs}"
        for run, parts in zip(plan.runs, plan.parts):  # a process's parts are exactly its tensors' bytes
            if run and parts:
                assert parts[-1].stop == offsets[run[-1]] + nbytes[run[-1]], f"{run} vs {parts}"


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An optimizer-only checkpoint of 32 MiB at world size 2 (4 units of 1 Mi float32 elements, Adam), so that two
    processes each put parts over S3's 5 MiB minimum."""
    flats, names = [], []
    for u in range(4):
        spec = ParamSpec(f"u{u}.w", (1 << 20,), 0)
        flats.append(FlatParamLayout(f"u{u}", (spec,), 2, 0, torch.float32, True))
        names.append(spec.name)
    layout = ModelLayout(tuple(flats), tuple(names), 2, 0)
    g = torch.Generator().manual_seed(0)
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(1 << 20, generator=g),
                 "exp_avg_sq": torch.rand(1 << 20, generator=g)} for i in range(4)}  # fmt: skip
    meta = {"version": FORMAT_VERSION, "optimizer": "Adam", "world_size": 2, "scalar_keys": ["step"]}
    full = {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(4))}],
            "param_names": dict(enumerate(names)), FORMAT_KEY: meta}  # fmt: skip
    src = tmp_path_factory.mktemp("multipart") / "big"
    fsdp_optim.reshard(full, 2, src, layout=layout)
    return src


@pytest.fixture(scope="module")
def local(big: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The file one process writes locally: what every upload must equal."""
    out = tmp_path_factory.mktemp("multipart") / "one.safetensors"
    assert main(["consolidate", str(big), "-o", str(out)]) == 0, "the local consolidate"
    return out.read_bytes()


def _fs(s3: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)


def _object(s3: Any, url: str) -> tuple[bytes | None, str | None, list[Any]]:
    """The object's bytes and etag (``None`` when absent) and the key's unfinished uploads."""
    fs = _fs(s3)
    bucket, key, _ = fs.split_path(url)
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
    if not fs.exists(url):
        return None, None, uploads
    return fs.cat_file(url), str(fs.info(url).get("ETag")), uploads


def _cli(s3: Any, *argv: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fsdp_optim", *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def test_one_process_writes_one_upload_of_the_local_bytes(s3_server: Any, big: Path, local: bytes) -> None:
    """The CLI, one process: the object is the local file byte for byte, put as one multipart upload (its etag
    says one part: s3fs would put a 32 MiB file whole, etag without a part count); a second run without
    --overwrite is refused and leaves it as it was; with --overwrite it writes it again."""
    url = s3_server.url("one") + "/model.safetensors"
    done = _cli(s3_server, "consolidate", big, "-o", url)
    assert done.returncode == 0 and done.stdout.startswith(f"wrote {url}: safetensors, one file"), done.stderr
    data, etag, pending = _object(s3_server, url)
    assert data == local, "the object differs from the local file"
    assert etag is not None and etag.strip('"').endswith("-1"), f"not one multipart upload of one part: {etag}"
    assert pending == [], f"unfinished uploads left: {pending}"
    again = _cli(s3_server, "consolidate", big, "-o", url)
    assert again.returncode == 1 and "an object is there already" in again.stderr, again.stderr
    assert _object(s3_server, url)[0] == local, "the refused run changed the object"
    assert _cli(s3_server, "consolidate", big, "-o", url, "--overwrite").returncode == 0, "--overwrite"


def test_parts_of_one_process_api(s3_server: Any, big: Path, local: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API with 10 MiB parts: several parts, the object still the local file's bytes."""
    from fsdp_optim.offline.onefile import consolidate_to_safetensors
    from fsdp_optim.offline.sources import open_source

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    url = s3_server.url("api") + "/model.safetensors"
    with open_source(str(big)) as opened:
        consolidate_to_safetensors(opened, url, rank=None, no_model=False, inputs=(), overwrite=False, progress=None,
                                   part_bytes=10 * MiB)  # fmt: skip
    data, etag, pending = _object(s3_server, url)
    assert data == local and pending == [], "the object differs from the local file, or uploads are left"
    assert etag is not None and etag.strip('"').endswith("-4"), f"32 MiB and the header in parts of at most 10 MiB: 4: {etag}"


def _pair(s3: Any, argv: list[Any], how: dict[int, str]) -> list[tuple[int, str, str]]:
    """Processes 0 and 1 of 2, as torchrun starts them, with the server's environment."""
    from _dist import free_port

    port = free_port()
    env = {**os.environ, **s3.env, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, how.get(r, "-"), *map(str, argv)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


def test_two_processes_put_the_parts_of_one_upload(s3_server: Any, big: Path, local: bytes) -> None:
    """Two processes, each its half (16 MiB, one part each): one object of two parts, the local file's bytes."""
    url = s3_server.url("two") + "/model.safetensors"
    results = _pair(s3_server, ["consolidate", big, "-o", url], {})
    assert [code for code, _, _ in results] == [0, 0], results
    assert results[0][1].startswith(f"wrote {url}: safetensors, one file") and results[1][1] == "", results
    data, etag, pending = _object(s3_server, url)
    assert data == local, "two processes uploaded other bytes than one writes"
    assert etag is not None and etag.strip('"').endswith("-2"), f"not one upload of two parts: {etag}"
    assert pending == [], f"unfinished uploads left: {pending}"


def test_two_processes_and_a_file_under_the_least_part(s3_server: Any, tmp_path: Path) -> None:
    """A whole checkpoint's file under S3's least part: process 1's run is too short for a part of its own, so
    process 0 writes it too (core/parts.plan_parts) and puts the one part; the object is the local file's bytes."""
    src = ROOT / "tests" / "fixtures" / "v3_whole_w2" / "ckpt"
    out = tmp_path / "one.safetensors"
    assert main(["consolidate", str(src), "-o", str(out)]) == 0, "the local consolidate"
    url = s3_server.url("small") + "/model.safetensors"
    results = _pair(s3_server, ["consolidate", src, "-o", url], {})
    assert [code for code, _, _ in results] == [0, 0], results
    data, etag, pending = _object(s3_server, url)
    assert data == out.read_bytes(), "two processes uploaded other bytes than one writes"
    assert etag is not None and etag.strip('"').endswith("-1") and pending == [], f"one part, none left: {etag}"


def test_a_killed_process_leaves_no_object(s3_server: Any, big: Path, local: bytes) -> None:
    """Process 1 killed (SIGKILL) once its part is put: process 0 fails, aborts the upload: no object, no
    unfinished upload; a rerun writes the object."""
    url = s3_server.url("kill") + "/model.safetensors"
    results = _pair(s3_server, ["consolidate", big, "-o", url], {1: "kill"})
    assert results[1][0] == -9 and results[0][0] == 1, results
    assert "fsdp-optim: error:" in results[0][2], results[0][2]
    data, _, pending = _object(s3_server, url)
    assert data is None and pending == [], f"an object or an unfinished upload was left: {pending}"
    assert [code for code, _, _ in _pair(s3_server, ["consolidate", big, "-o", url], {})] == [0, 0], "the rerun"
    assert _object(s3_server, url)[0] == local, "the rerun's object"


def test_a_store_without_multipart_gets_the_file_uploaded_whole(big: Path, local: bytes) -> None:
    """fsspec's memory filesystem has no multipart API: the file is written locally and uploaded whole."""
    import fsspec

    from fsdp_optim.offline.onefile import consolidate_to_safetensors
    from fsdp_optim.offline.sources import open_source

    url = "memory://multipart-fallback/x/model.safetensors"
    with open_source(str(big)) as opened:
        consolidate_to_safetensors(opened, url, rank=None, no_model=False, inputs=(), overwrite=False, progress=None)
    assert fsspec.filesystem("memory").cat_file(url) == local, "the uploaded file differs from the local one"


def test_a_store_fault_aborts_the_upload(fault_proxy: Any, s3_server: Any, big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every put of part 2 answered 500 (through the fault proxy): the write fails naming the part once the store's
    deadline has passed, and the upload is aborted: no object, no unfinished upload."""
    from _fault_proxy import Fault

    from fsdp_optim.offline.onefile import consolidate_to_safetensors
    from fsdp_optim.offline.sources import open_source

    for k, v in fault_proxy.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FSDP_OPTIM_STORE_DEADLINE_S", "5")
    fault_proxy.set_faults(Fault("status500", count=None, methods={"PUT"}, path="partNumber=2"))
    url = fault_proxy.url("fault") + "/model.safetensors"
    with open_source(str(big)) as opened, pytest.raises(OSError, match="part 2") as failed:
        consolidate_to_safetensors(opened, url, rank=None, no_model=False, inputs=(), overwrite=False, progress=None,
                                   part_bytes=10 * MiB)  # fmt: skip
    fault_proxy.set_faults()
    data, _, pending = _object(s3_server, url)
    assert data is None and pending == [], f"an object or an unfinished upload was left ({failed.value}): {pending}"


def test_a_lost_completion_answer_is_a_success(fault_proxy: Any, s3_server: Any, big: Path, local: bytes,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The completion is stored but its answer lost (the proxy closes the connection): the client's retry of the
    completion is answered with success (SeaweedFS takes a repeated completion of a completed upload), and the object
    is the local file's bytes, no upload left."""
    from _fault_proxy import Fault

    from fsdp_optim.offline.onefile import consolidate_to_safetensors
    from fsdp_optim.offline.sources import open_source

    for k, v in fault_proxy.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FSDP_OPTIM_STORE_DEADLINE_S", "10")
    fault_proxy.set_faults(Fault("drop_response", count=1, methods={"POST"}, path="uploadId="))
    url = fault_proxy.url("lost") + "/model.safetensors"
    with open_source(str(big)) as opened:
        consolidate_to_safetensors(opened, url, rank=None, no_model=False, inputs=(), overwrite=False, progress=None,
                                   part_bytes=10 * MiB)  # fmt: skip
    assert fault_proxy.stats().faults.get("drop_response") == 1, f"the fault did not fire: {fault_proxy.stats()}"
    fault_proxy.set_faults()
    data, _, pending = _object(s3_server, url)
    assert data == local and pending == [], "the object differs from the local file, or uploads are left"
