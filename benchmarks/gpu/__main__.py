"""``python -m benchmarks.gpu [--small] [--repeats N] [--dir DIR]``: the GPU checkpoint table (see the package doc).

Prints the table with each row against its floor and against DCP (default, and with its best staging), the issue's
targets with a verdict each (``report``), and writes ``benchmarks/results/gpu_staging{,_small}.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu import loop as loop_mod
from benchmarks.gpu import report, rows
from benchmarks.gpu.floors import Floors
from benchmarks.gpu.models import Config, dcp_model, ours
from benchmarks.measure import tensor_bytes
from benchmarks.report import RESULTS, Run, verdict_lines, write


def _config(args: argparse.Namespace) -> Config:
    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu") if small else torch.device("cuda", 0)
    layers, dim = (8, 512) if small else (32, 4096)
    return Config(layers, dim, 8, device, args.dir, args.repeats)


def _join(config: Config) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if config.on_gpu else "gloo"
    if config.on_gpu:
        torch.cuda.set_device(config.device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip


def measure(config: Config, model_name: str) -> tuple[list[dict[str, Any]], int]:
    """Every row (``report.rows_of``) and the state's bytes."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, optim = ours(config)
    tensors = [p for p in model.parameters()] + [v for s in optim.state.values() for v in s.values() if v.dim()]
    floors = Floors(tensors, config)
    least = {name: min(fn() for _ in range(config.repeats + 1)) for name, fn in (("pinned copy", floors.copy), ("sync save", floors.save), ("load", floors.load))}
    floors.remove()
    mine = rows.ours(model, optim, config)
    training = loop_mod.loop(model, optim, config)
    nbytes = tensor_bytes(tensors)
    del model, optim, floors, tensors
    dmodel, doptim = dcp_model(config)
    default = rows.dcp_rows(dmodel, doptim, config)
    gpu = config.on_gpu  # pinned memory and non-blocking copies need an accelerator: on the CPU, the other two
    best_stager = DefaultStager(StagingOptions(gpu, True, True, gpu))
    try:
        best = rows.dcp_rows(dmodel, doptim, config, stager=best_stager)
    finally:
        best_stager.close()
    peers = {name: {**t.medians(), **t.growth} for name, t in (("ours", mine), ("dcp", default), ("dcp best staging", best))}
    return report.rows_of(model_name, least, peers, training), nbytes


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the CPU mode (the default without CUDA)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up round")
    parser.add_argument("--dir", default="/dev/shm/fsdp_optim_gpu_bench", help="checkpoint directory (tmpfs)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    config = _config(args)
    run = Run("python -m benchmarks.gpu", argv, backend="cpu:gloo,cuda:nccl" if config.on_gpu else "gloo")
    device = torch.cuda.get_device_name(0) if config.on_gpu else "the CPU"
    run.meta |= {"device": device, "model": f"{config.layers} x Linear({config.dim}, {config.dim}) nested, Adam, W=1", "repeats": config.repeats}
    os.makedirs(config.directory, exist_ok=True)
    _join(config)
    try:
        result, run.meta["state_bytes"] = measure(config, f"{config.layers}x{config.dim}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(config.directory, ignore_errors=True)
    meta = run.finish()
    targets = report.targets(result)
    paths = write(RESULTS, "gpu_staging" if config.on_gpu else "gpu_staging_small", rows=result, meta=meta, targets=targets, markdown=report.markdown)
    run.done(paths, paths["md"].read_text(), verdict_lines(targets))


if __name__ == "__main__":
    main()
