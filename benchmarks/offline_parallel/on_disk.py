"""One process, on disk: ``python -m benchmarks.offline_parallel --size-gib 16 --on-disk --scratch DIR``.

Issue 42's last target: a 16 GiB state resharded by one process in <= 1 GiB RSS (mapped pages included) at
<= 1.3x the read-all-write-all floor, on a disk file system where the source and the output do not both fit in
memory. The steps, in one run:

1. the synthetic checkpoint of :func:`.timed.make_source` (world size 2) written into ``DIR/src`` by the package's
   streamed writer, one shard at a time (an existing ``DIR/src`` of the same size is reused);
2. every source file dropped from the page cache (``posix_fadvise(DONTNEED)``; its resident bytes before and after,
   by ``fincore``, say whether it worked);
3. the floor: every source byte read and as many bytes written to 3 files, 8 MiB at a time (the writer's and the
   checker's piece), each output file fsynced: ``dd`` with the reshard's own output count;
4. the source dropped again, then ``fsdp-optim reshard DIR/src --world-size 3 -o DIR/out`` in a process of its own
   (:func:`.timed._launch`: its wall time, its ``VmHWM``), and ``inspect`` under the same launcher (start-up).

Every phase records its seconds, bytes and the load average around it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..peak import ROOT
from .timed import _launch, make_source
from .worker import schedstat

PIECE = 8 << 20
OUTPUT_FILES = 3


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def resident(files: Sequence[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (``fincore``), or ``None`` where ``fincore`` is missing."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return sum(int(v) for v in out.split())


def dropped(files: Sequence[Path]) -> dict[str, Any]:
    """Each file's clean pages dropped from the page cache (fsync first, then ``POSIX_FADV_DONTNEED``); resident
    bytes before and after."""
    before = resident(files)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"resident_before": before, "resident_after": resident(files), "bytes": sum(p.stat().st_size for p in files)}


def _phase(name: str, fn: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    load_before = os.getloadavg()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    print(f"{name}: {seconds:.1f} s, load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    return {"phase": name, "seconds": seconds, "load_before": list(load_before), "load_after": list(os.getloadavg())}, result


def floor(sources: Sequence[Path], out: Path, parts: int = OUTPUT_FILES) -> int:
    """Read every byte of ``sources`` in ``PIECE`` reads and write the same bytes, in order, into ``parts`` files of
    ``out`` (fsynced, then the directory); the bytes written."""
    total = sum(p.stat().st_size for p in sources)
    share = -(-total // parts)
    out.mkdir()
    buffer = bytearray(PIECE)
    view = memoryview(buffer)
    written, outputs = 0, [os.open(out / f"part{k}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644) for k in range(parts)]
    try:
        for path in sources:
            fd = os.open(path, os.O_RDONLY)
            try:
                while n := os.readv(fd, [buffer]):
                    at = 0
                    while at < n:  # a piece may straddle two output files
                        k = written // share
                        step = min(n - at, share * (k + 1) - written)
                        os.write(outputs[k], view[at : at + step])
                        at, written = at + step, written + step
            finally:
                os.close(fd)
        for fd in outputs:
            os.fsync(fd)
    finally:
        for fd in outputs:
            os.close(fd)
    directory = os.open(out, os.O_RDONLY)
    os.fsync(directory)
    os.close(directory)
    return written


def _source(src: Path, gib: float) -> tuple[dict[str, Any], int]:
    if (src / "manifest.json").exists():
        size = sum(p.stat().st_size for p in _files(src) if p.name != "manifest.json")
        return {"phase": "make source (reused)", "seconds": None, "load_before": list(os.getloadavg())}, size
    return _phase("make source", lambda: make_source(src, gib))


def run(gib: float, scratch: Path, *, keep: bool = False) -> dict[str, Any]:
    """The steps of the module docstring in ``scratch``; every phase's record. ``scratch/src`` is removed at the
    end unless ``keep``."""
    scratch.mkdir(parents=True, exist_ok=True)
    src, out, plain = scratch / "src", scratch / "out", scratch / "floor"
    for stale in (out, plain):
        shutil.rmtree(stale, ignore_errors=True)
    made, size = _source(src, gib)
    phases = [made]
    sources = _files(src)
    drops = [dropped(sources)]
    before = schedstat()  # (the floor runs on this process's main thread alone)
    record, written = _phase("floor: read all, write all", lambda: floor(sources, plain))
    used = [a - b for a, b in zip(schedstat(), before)]
    phases.append(record | {"bytes_read": sum(p.stat().st_size for p in sources), "bytes_written": written, "schedstat": used})
    shutil.rmtree(plain)
    drops.append(dropped(sources))
    report = scratch / "report"
    record, reports = _phase("reshard 2 -> 3, one process",
                             lambda: _launch(1, ["reshard", str(src), "--world-size", str(OUTPUT_FILES), "-o", str(out)], report))  # fmt: skip
    out_bytes = sum(p.stat().st_size for p in _files(out))
    phases.append(record | {"bytes_read": size, "bytes_written": out_bytes, "peak_rss": reports[0]["peak_rss"], "worker_seconds": reports[0]["seconds"],
                            "schedstat": reports[0]["schedstat"]})  # fmt: skip
    record, _ = _phase("launcher: inspect", lambda: _launch(1, ["inspect", str(src)], report))
    phases.append(record)
    shutil.rmtree(out)
    if not keep:
        shutil.rmtree(src)
    return {"gib": gib, "input_bytes": size, "scratch": str(scratch), "phases": phases, "drops": drops,
            "page_cache_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}  # fmt: skip


NOTES = (
    "The floor is one thread reading 8 MiB at a time and writing each piece at once (the kernel's write-back "
    "overlaps the writes with the next reads, as it does for the reshard); no hashing, no format.",
    "The reshard is the CLI verb in a fresh interpreter (torch imported), timed from spawn to exit; the launcher row "
    "is `inspect` under the same launcher (start-up and reading the manifest).",
    "Peak RSS is the reshard process's VmHWM: anonymous memory and mapped file pages resident at once.",
    "CPU s / run-queue s: the scheduler's account (`schedstat`) of the phase's threads: seconds on a CPU, and seconds "
    "runnable but waiting for one while other work held both cores (the reshard's threads alive at its exit; the "
    "floor's one thread). Wall time less the run-queue wait is shown as a diagnostic, not as the target.",
)


def meta(argv: Sequence[str] | None, scratch: Path) -> dict[str, Any]:
    """The run's header: command, machine, the scratch file system, commit."""
    command = "python -m benchmarks.offline_parallel " + " ".join(argv if argv is not None else sys.argv[1:])
    mounts = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", str(scratch)], capture_output=True, text=True, check=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"command": command.strip(), "machine": f"{os.cpu_count()} cores, {memory / (1 << 30):.1f} GiB memory",
            "filesystem": mounts.stdout.strip() or "unknown", "commit": head.stdout.strip() or "unknown"}  # fmt: skip
