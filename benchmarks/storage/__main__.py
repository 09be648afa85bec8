"""Benchmark: whole checkpoints on an S3 server: ``save_checkpoint`` / ``async_save_checkpoint`` / ``load_checkpoint``
to and from ``s3://`` against s3fs upload and download floors and DCP's ``FsspecWriter`` / ``FsspecReader``, the bytes
a re-cut load fetches, and ``reshard`` / ``consolidate`` from the store (the commands and latest figures:
docs/benchmarks.md, "Object storage").

One SeaweedFS server (``weed mini``, started here on loopback, data in ``--dir``: on a machine whose memory is shared,
``--dir /tmp``, as a 100M run holds ~6-10 GB) serves the run. World sizes run one after another in fresh gloo jobs
(``job.py``'s ``run_whole`` on the store), each loading a checkpoint a job of another world size saved into another FSDP
nesting, once more through a counting proxy; then the offline tools run in this process on the smallest W's checkpoint (``offline``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import fsdp_optim

from .. import job, models, spawn
from ..host import load_average, storage
from ..report import Run
from . import offline, report, server

# ---- configuration ---------------------------------------------------------------------------------
MODEL = "100M"
WORLD_SIZES = (2, 4)
WARMUP = 1
REPEATS = 3
OFFLINE_REPEATS = 2  # each call moves the checkpoint twice (~1.2 GB down, ~1.2 GB up at 100M)
RESHARD_TO = 3  # the offline reshard's world size
STEPS = 1  # Adam steps before the first save
QUICK = {"model": "5M", "repeats": 3}
STORAGE = Path("/dev/shm")  # tmpfs for the server's data: the time is the server's and the client's, not a disk's
COLLECTIVE_TIMEOUT_S = 1800
# -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.storage", description=__doc__.split("\n")[0])
    spawn.options(p, warmup=WARMUP, repeats=REPEATS, steps=STEPS, storage=STORAGE, name="storage")
    p.add_argument("--model", help=f"a preset {sorted(models.PRESETS)} or WIDTHxBLOCKS (default {MODEL})")
    p.add_argument("--offline-repeats", type=int, default=OFFLINE_REPEATS)
    p.add_argument("--no-offline", action="store_true", help="skip reshard / consolidate from the store")
    args = spawn.resolve(p.parse_args(argv), world_sizes=WORLD_SIZES, repeats=REPEATS, quick_repeats=QUICK["repeats"], storage=STORAGE, name="storage")  # type: ignore[arg-type]
    args.spec = models.parse_model(args.model or (QUICK["model"] if args.quick else MODEL))
    if args.repeats < 1 or args.warmup < 0 or args.offline_repeats < 1 or min(args.world_sizes) < 2:
        p.error("--repeats, --offline-repeats must be >= 1, --warmup >= 0, world sizes >= 2 (W=1 is not sharded)")
    return args


def run_jobs(args: argparse.Namespace, srv: Any, proxy: Any, refs: Path, log: Any) -> tuple[list[dict[str, Any]], dict[int, str]]:
    other, endpoint = spawn.plan(args.world_sizes), srv.endpoint
    store = job.Store(
        root=fsdp_optim.open_store(f"s3://{endpoint.bucket}/run", **endpoint.storage_options),
        counted=fsdp_optim.open_store(f"s3://{endpoint.bucket}/run", **proxy.storage_options), storage_options=endpoint.storage_options,
        vacuum_url=f"http://127.0.0.1:{srv.ports['master.port']}/vol/vacuum?garbageThreshold=0.001",
    )  # fmt: skip

    def cfg(world_size: int, source_only: bool) -> job.JobConfig:
        return job.JobConfig(
            model=args.spec, steps=args.steps, warmup=args.warmup, repeats=args.repeats, work="", refs=str(refs), store=store,
            other=other[world_size], publish_ref=world_size in other.values(), source_only=source_only,
        )  # fmt: skip

    def after(world_size: int, payload: Any, needed: set[int | None]) -> None:
        payload["recut_fetched_bytes"] = server.get_bytes(proxy.stats()) if payload.get("recut_held_bytes") else None
        for name in job.scratch(world_size).values():  # this job's scratch prefixes (fresh names per job)
            store.root.fs.rm(store.root.key(name), recursive=True)
        server.vacuum(srv)

    return spawn.jobs(args.world_sizes, args.spec, job.run_whole, cfg, report, log, after=after, before=lambda _: proxy.reset_stats(),
                      timeout_s=COLLECTIVE_TIMEOUT_S, deadline_s=5400)  # fmt: skip


def run_offline(args: argparse.Namespace, srv: Any, log: Any) -> list[dict[str, Any]]:
    world_size = args.world_sizes[0]
    spec = args.spec
    endpoint = srv.endpoint
    root = fsdp_optim.open_store(f"s3://{endpoint.bucket}/run", **endpoint.storage_options)
    log(f"offline: reshard {world_size} -> {RESHARD_TO} and consolidate, store to store (load average {load_average()})")
    results = offline.measure(
        root.child(f"whole-W{world_size}"), root.child("offline"), world_size=RESHARD_TO, warmup=args.warmup,
        repeats=args.offline_repeats, env=endpoint.env, compact=lambda: server.vacuum(srv),
    )
    rows = report.rows_of(spec.name, world_size, {"results": results})
    print(report.console(rows), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    run = Run("python -m benchmarks.storage", argv, versions=_client_versions())
    run.meta |= {
        "models": ", ".join(f"W={w}: {args.spec.name} ({args.spec.numel / 1e6:.1f}M parameters)" for w in args.world_sizes),
        "world_sizes": list(args.world_sizes),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "offline_repeats": args.offline_repeats,
        "offline_source": f"W={args.world_sizes[0]}'s checkpoint, resharded to W={RESHARD_TO}",
        "steps": args.steps,
    }
    with spawn.scratch("fsdp_optim_storage_", args.dir) as (data, refs):  # the references on disk: tmpfs holds the server's data
        srv = server.start(data)
        proxy = server.counting_proxy(srv.endpoint)
        run.meta["server"] = f"SeaweedFS `weed mini` ({_weed_version()}) on 127.0.0.1, data in {storage(args.dir)}; the same 2 cores as the ranks"
        try:
            rows, loads = run_jobs(args, srv, proxy, refs, run.log)
            if not args.no_offline:
                rows += run_offline(args, srv, run.log)
        finally:
            proxy.close()
            srv.stop()
    run.meta["job_loads"] = "; ".join(f"W={w}: {load}" for w, load in loads.items())
    run.close(report, rows, args.out, args.name, value=".3f")
    return 0


def _client_versions() -> str:
    import aiobotocore
    import s3fs

    return f"s3fs {s3fs.__version__}, aiobotocore {aiobotocore.__version__}"


def _weed_version() -> str:
    import subprocess

    weed = shutil.which("weed")
    if weed is None:
        return "weed not found"
    out = subprocess.run([weed, "version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return out.splitlines()[0] if out else "weed"


if __name__ == "__main__":
    raise SystemExit(main())
