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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu import loop as loop_mod
from benchmarks.gpu import report, rows
from benchmarks.gpu.floors import Floors
from benchmarks.gpu.models import Config, dcp_model, ours
from benchmarks.measure import tensor_bytes
from benchmarks.registry import RESULTS
from benchmarks.report import Run, verdict_lines, write


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


class Progress:
    """What is measured so far: ``publish(stage)`` writes it as the run's results, marked partial in the meta, so
    that a run ended by its bound leaves every row it had measured; ``main`` writes the whole once done."""

    def __init__(self, config: Config, run: Run, out: Path) -> None:
        self.config, self.run, self.out = config, run, out
        self.model = f"{config.layers}x{config.dim}"
        self.least: dict[str, float] = {}
        self.peers: dict[str, dict[str, float]] = {peer: {} for peer in report.PEERS}
        self.training: dict[str, Any] = {}

    def add(self, peer: str, tally: rows.Tally) -> None:
        self.peers[peer] |= {**tally.medians(), **tally.growth}
        self.run.log(f"{peer}: {_ms(tally.medians())}")

    def rows(self) -> list[dict[str, Any]]:
        return report.rows_of(self.model, self.least, self.peers, self.training)

    def publish(self, stage: str) -> dict[str, Any]:
        meta = self.run.finish() | ({"partial": f"measured up to {stage}"} if stage else {})
        result = self.rows()
        return write(self.out, _name(self.config), rows=result, meta=meta, targets=report.targets(result), markdown=report.markdown)


def _name(config: Config) -> str:
    return "gpu_staging" if config.on_gpu else "gpu_staging_small"


def measure(config: Config, progress: Progress) -> None:
    """Every row (``report.rows_of``) into ``progress``, published after each stage: on a GPU the NCCL rows first
    (a run its bound ends keeps them), then the floors, ours, the loop and DCP's."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if config.on_gpu:
        progress.add("ours", rows.nccl_blocking(config))
        progress.publish("nccl")
    model, optim = ours(config)
    tensors = [p for p in model.parameters()] + [v for s in optim.state.values() for v in s.values() if v.dim()]
    progress.run.meta["state_bytes"] = tensor_bytes(tensors)
    floors = Floors(tensors, config)
    progress.least = {name: min(fn() for _ in range(config.repeats + 1)) for name, fn in (("pinned copy", floors.copy), ("sync save", floors.save), ("load", floors.load))}
    floors.remove()
    progress.run.log(f"floors: {_ms(progress.least)}")
    progress.add("ours", rows.ours(model, optim, config))
    progress.publish("ours")
    budget, least = (15.0, loop_mod.LEAST) if config.on_gpu else (4.0, 4)  # two loops within the run's bound
    progress.training = loop_mod.loop(model, optim, config, save_s=progress.peers["ours"]["async save, committed"], budget_s=budget, least=least)
    progress.run.log(f"loop: {progress.training}")
    del model, optim, floors, tensors
    dmodel, doptim = dcp_model(config)
    progress.add("dcp", rows.dcp_rows(dmodel, doptim, config))
    progress.publish("dcp")
    theirs = _dcp_loop(dmodel, doptim, config, progress.peers["dcp"]["async save, committed"], budget, least)
    progress.training |= {f"dcp: {k}": v for k, v in theirs.items() if k not in ("step clock",)}  # measured the same way
    progress.run.log(f"dcp loop: {theirs}")
    progress.publish("dcp loop")
    gpu = config.on_gpu  # pinned memory and non-blocking copies need an accelerator: on the CPU, the other two
    best_stager = DefaultStager(StagingOptions(gpu, True, True, gpu))
    try:
        progress.add("dcp best staging", rows.dcp_rows(dmodel, doptim, config, stager=best_stager))
    finally:
        best_stager.close()
    del dmodel, doptim


def _dcp_loop(model: Any, optim: torch.optim.Optimizer, config: Config, save_s: float, budget_s: float, least: int) -> dict[str, Any]:
    """The training loop with DCP's ``async_save`` as users call it, timed as ours is."""
    import torch.distributed.checkpoint as dcp

    def save(path: str) -> loop_mod.DcpHandle:
        return loop_mod.DcpHandle(dcp.async_save(rows.dcp_state(model, optim), checkpoint_id=path))

    return loop_mod.loop(model, optim, config, save_s=save_s, budget_s=budget_s, save=save, least=least)


def _ms(medians: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())


_STOPPED: list[int] = []  # the signal that ended the run, if one did


def _stop(signum: int, _frame: Any) -> None:
    _STOPPED.append(signum)
    raise SystemExit(128 + signum)  # through every finally: the checkpoints in --dir are removed


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the CPU mode (the default without CUDA)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up round")
    parser.add_argument("--dir", default="/dev/shm/fsdp_optim_gpu_bench", help="checkpoint directory (tmpfs)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default: benchmarks/results)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    config = _config(args)
    run = Run("python -m benchmarks.gpu", argv, backend="cpu:gloo,cuda:nccl" if config.on_gpu else "gloo")
    device = torch.cuda.get_device_name(0) if config.on_gpu else "the CPU"
    run.meta |= {"device": device, "model": f"{config.layers} x Linear({config.dim}, {config.dim}) nested, Adam, W=1", "repeats": config.repeats}
    if not config.on_gpu:
        run.meta["stand-ins"] = rows.STAND_IN
    signal.signal(signal.SIGTERM, _stop)
    shutil.rmtree(config.directory, ignore_errors=True)  # what a killed run left
    os.makedirs(config.directory)
    atexit.register(shutil.rmtree, config.directory, True)  # again after a background save's thread has ended
    progress = Progress(config, run, args.out)
    try:
        _join(config)
        run.log(f"{run.meta['model']} on {device}, files in {config.directory}")
        measure(config, progress)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(config.directory, ignore_errors=True)
        if _STOPPED:  # (also where the code it landed in caught the SystemExit and went on: a stopped run is one)
            raise SystemExit(128 + _STOPPED[0])
    paths = progress.publish("")
    run.done(paths, paths["md"].read_text(), verdict_lines(report.targets(progress.rows())))


if __name__ == "__main__":
    main()
