"""``python -m benchmarks.gpu [--small] [--repeats N] [--dir DIR]``: the GPU checkpoint table (see the package doc).

Prints the table with each row against its floor and against DCP (default, and with its best staging), the issue's
targets with a verdict each (``report``), and writes ``benchmarks/results/gpu_staging{,_small}.{json,md}``. Prints
as it goes (flushed); SIGTERM (``timeout``) and Ctrl-C end it through its cleanup, which removes ``--dir`` (its
checkpoints in /dev/shm, several times the state's size).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import shutil
import signal
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


def measure(config: Config, model_name: str, log: Any = print) -> tuple[list[dict[str, Any]], int]:
    """Every row (``report.rows_of``) and the state's bytes; ``log`` says where it is."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, optim = ours(config)
    tensors = [p for p in model.parameters()] + [v for s in optim.state.values() for v in s.values() if v.dim()]
    floors = Floors(tensors, config)
    least = {name: min(fn() for _ in range(config.repeats + 1)) for name, fn in (("pinned copy", floors.copy), ("sync save", floors.save), ("load", floors.load))}
    floors.remove()
    log(f"floors: {', '.join(f'{k} {v * 1e3:.1f} ms' for k, v in least.items())}")
    mine = rows.ours(model, optim, config)
    log(f"ours: {_ms(mine.medians())}")
    training = loop_mod.loop(model, optim, config, save_s=mine.medians()["async save, committed"])
    log(f"loop: {training}")
    nbytes = tensor_bytes(tensors)
    del model, optim, floors, tensors
    dmodel, doptim = dcp_model(config)
    default = rows.dcp_rows(dmodel, doptim, config)
    log(f"dcp: {_ms(default.medians())}")
    gpu = config.on_gpu  # pinned memory and non-blocking copies need an accelerator: on the CPU, the other two
    best_stager = DefaultStager(StagingOptions(gpu, True, True, gpu))
    try:
        best = rows.dcp_rows(dmodel, doptim, config, stager=best_stager)
    finally:
        best_stager.close()
    log(f"dcp best staging: {_ms(best.medians())}")
    del dmodel, doptim
    if gpu:
        mine.seconds |= rows.nccl_blocking(config).seconds
        log(f"ours on an NCCL group: {_ms({k: v for k, v in mine.medians().items() if 'NCCL' in k})}")
    peers = {name: {**t.medians(), **t.growth} for name, t in (("ours", mine), ("dcp", default), ("dcp best staging", best))}
    return report.rows_of(model_name, least, peers, training), nbytes


def _ms(medians: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # through every finally: the checkpoints in --dir are removed


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
    signal.signal(signal.SIGTERM, _stop)
    shutil.rmtree(config.directory, ignore_errors=True)  # what a killed run left
    os.makedirs(config.directory)
    atexit.register(shutil.rmtree, config.directory, True)  # again after a background save's thread has ended
    try:
        _join(config)
        run.log(f"{run.meta['model']} on {device}, files in {config.directory}")
        result, run.meta["state_bytes"] = measure(config, f"{config.layers}x{config.dim}", run.log)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(config.directory, ignore_errors=True)
    meta = run.finish()
    targets = report.targets(result)
    paths = write(RESULTS, "gpu_staging" if config.on_gpu else "gpu_staging_small", rows=result, meta=meta, targets=targets, markdown=report.markdown)
    run.done(paths, paths["md"].read_text(), verdict_lines(targets))


if __name__ == "__main__":
    main()
