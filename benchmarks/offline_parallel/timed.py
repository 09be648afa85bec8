"""The run here: a synthetic optimizer-only checkpoint of ``gib`` GiB (64 units, Adam's two fp32 keys) written on
tmpfs at world size 2 by the package's own streamed writer, then resharded 2 -> 3 (and consolidated) by the plain
one-process CLI and by ``torchrun --nproc_per_node 2``, in interleaved rounds (:func:`sample`); each timed net of its
launcher running ``inspect`` (reads the manifest only), best of the rounds (:func:`best`). Bytes read per process are
what its plan reads (``reshard.share_spans`` of its share: the chunk-widened ranges the reader maps and verifies,
headers included; mmap reads on tmpfs count no I/O to measure)."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import FlatRecord, GroupRecord, StateEntry
from fsdp_optim.core.source import Source
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.streamed import streamed_parts
from fsdp_optim.formats.sharded.writer import write_manifest, write_shard_file
from fsdp_optim.offline.cuts import planned_manifest
from fsdp_optim.offline.parallel.reshard import plan_reshard, share_spans

from ..peak import ROOT

UNITS = 64
SHM = Path("/dev/shm")


def _read(flat: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
    out.fill_(flat + len(key) / 16)  # cheap: the values do not matter to a re-cut's speed, and each unit differs


def make_source(directory: Path, gib: float) -> int:
    """The synthetic checkpoint (module docstring) in ``directory``; its bytes."""
    numel = int(gib * (1 << 30) / UNITS / 8)
    flats = tuple(FlatParamLayout(f"u{u}", (ParamSpec(f"u{u}.w", (numel,), 0),), 2, 0, torch.float32, True)
                  for u in range(UNITS))  # fmt: skip
    state = (StateEntry("exp_avg", StateKind.SHARDED, dtype="float32"),
             StateEntry("exp_avg_sq", StateKind.SHARDED, dtype="float32"), StateEntry("step", StateKind.SCALAR, value=7))  # fmt: skip
    records = tuple(FlatRecord.from_layout(replace(f, world_size=1), state) for f in flats)
    source = Source("synthetic", "Adam", records, (GroupRecord({"lr": 1e-3}, tuple(range(UNITS))),), _read, 1)
    layout = ModelLayout(flats, tuple(f"u{u}.w" for u in range(UNITS)), 2, 0)
    the_plan = plan(source, layout)
    final = planned_manifest(the_plan, Manifest.from_layout(layout, save_id=new_save_id()))
    directory.mkdir()
    files = tuple(write_shard_file(directory, streamed_parts(the_plan, final, r, after_shard=lambda: None),
                                   save_id=final.save_id, rank=r, world_size=2, staged=True) for r in range(2))  # fmt: skip
    write_manifest(directory, replace(final, files=files))
    return sum(f.nbytes for f in files)


def planned_reads(src: Path, world_size: int, processes: int) -> list[int]:
    """Bytes of the source each of ``processes`` processes reads re-cutting it for ``world_size`` ranks."""
    with open_checkpoint(src) as ckpt:
        planned = plan_reshard(ckpt, world_size, new_save_id(), processes, "refuse")
        return [sum(s.stop - s.start for s in share_spans(ckpt, planned, planned.share(p))) for p in range(processes)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(processes: int, argv: list[str], report: Path) -> list[dict[str, Any]]:
    """``fsdp-optim ARGV`` by one process (the CLI's ``main`` in a fresh interpreter, no launcher) or by ``torchrun
    --nproc-per-node PROCESSES``; each process's report (:mod:`.worker`)."""
    module = ["-m", "benchmarks.offline_parallel.worker", str(report), *argv]
    if processes == 1:
        cmd = [sys.executable, *module]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", *module]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    found = sorted(report.parent.glob(report.name + ".*"))
    out = [json.loads(p.read_text()) for p in found]
    for p in found:
        p.unlink()
    return out


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def sample(src: Path, processes: int, verb: list[str], output: str) -> dict[str, Any]:
    """One round: ``inspect`` (the launcher's start-up) and then ``fsdp-optim VERB... -o OUT`` (``output``: OUT's
    name in a scratch directory) under the same launcher; the wall and CPU seconds of each (CPU: every process the
    launch made, the launcher's own included), and each process's peak RSS."""
    out: dict[str, Any] = {"processes": processes}
    with tempfile.TemporaryDirectory(dir=SHM) as scratch:
        for key, argv in (("launcher", ["inspect", str(src)]), ("verb", [*verb, "-o", str(Path(scratch) / output)])):
            cpu, start = _children_cpu(), time.perf_counter()
            reports = _launch(processes, argv, Path(scratch) / key)
            out[key] = [time.perf_counter() - start, _children_cpu() - cpu]
        out["peak_rss"] = [r["peak_rss"] for r in sorted(reports, key=lambda r: r["rank"])]
    return out


def best(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one launcher and verb summed up: best wall time of the verb and of the launcher alone, the net
    of the two (and the CPU seconds alike), the peak RSS of every round."""
    verb, noop = min(s["verb"][0] for s in samples), min(s["launcher"][0] for s in samples)
    cpu, noop_cpu = min(s["verb"][1] for s in samples), min(s["launcher"][1] for s in samples)
    peaks = [max(p) for p in zip(*(s["peak_rss"] for s in samples))]
    return {"processes": samples[0]["processes"], "seconds": verb, "launcher_seconds": noop, "net_seconds": verb - noop,
            "cpu_seconds": cpu, "net_cpu_seconds": cpu - noop_cpu, "rounds": len(samples), "peak_rss": peaks}  # fmt: skip
