"""``python -m benchmarks.gpu [--small] [--repeats N] [--dir DIR]``: the GPU checkpoint table (see the package doc).

Prints the table with each row against its floor and against DCP (default, and with its best staging), the issue's
targets with a verdict each, and writes ``benchmarks/results/gpu_staging{,_small}.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu import loop as loop_mod
from benchmarks.gpu import rows
from benchmarks.gpu.floors import Floors
from benchmarks.gpu.models import Config, dcp_model, ours, state_bytes

RESULTS = Path(__file__).resolve().parent.parent / "results"
GiB = 1 << 30


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


def measure(config: Config) -> dict[str, Any]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model, optim = ours(config)
    tensors = [p for p in model.parameters()] + [v for s in optim.state.values() for v in s.values() if v.dim()]
    floors = Floors(tensors, config)
    copy = min(floors.copy() for _ in range(config.repeats + 1))
    save = min(floors.save() for _ in range(config.repeats + 1))
    load = min(floors.load() for _ in range(config.repeats + 1))
    floors.remove()
    mine = rows.ours(model, optim, config)
    training = loop_mod.loop(model, optim, config)
    nbytes = state_bytes(optim, model)
    del model, optim, floors, tensors
    dmodel, doptim = dcp_model(config)
    default = rows.dcp_rows(dmodel, doptim, config)
    gpu = config.on_gpu  # pinned memory and non-blocking copies need an accelerator: on the CPU, the other two
    best_stager = DefaultStager(StagingOptions(gpu, True, True, gpu))
    try:
        best = rows.dcp_rows(dmodel, doptim, config, stager=best_stager)
    finally:
        best_stager.close()
    return {
        "state bytes": nbytes,
        "floors": {"pinned copy": copy, "sync save": save, "load": load},
        "ours": {**mine.medians(), **mine.growth},
        "dcp": {**default.medians(), **default.growth},
        "dcp best staging": {**best.medians(), **best.growth},
        "loop": training,
    }


def targets(r: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The issue's targets: (what, measured, met)."""
    f, o, d, b = r["floors"], r["ours"], r["dcp"], r["dcp best staging"]
    out = [
        ("async save blocking <= 50 ms", f"{o['async save, blocking'] * 1e3:.1f} ms", o["async save, blocking"] <= 0.05),
        ("async copy done <= 1.2x pinned copy floor", f"{o['async save, copied'] / f['pinned copy']:.2f}x",
         o["async save, copied"] <= 1.2 * f["pinned copy"]),
        ("sync save <= 1.15x floor", f"{o['sync save'] / f['sync save']:.2f}x", o["sync save"] <= 1.15 * f["sync save"]),
        ("sync save <= 0.5x DCP", f"{o['sync save'] / d['sync save']:.2f}x", o["sync save"] <= 0.5 * d["sync save"]),
        ("load <= 1.15x floor", f"{o['load'] / f['load']:.2f}x", o["load"] <= 1.15 * f["load"]),
        ("load <= 0.5x DCP", f"{o['load'] / d['load']:.2f}x", o["load"] <= 0.5 * d["load"]),
        ("host RSS growth of a later save <= 64 MiB", f"{o.get('sync save: host RSS', 0) / 2**20:.0f} / "
         f"{o.get('async save, blocking: host RSS', 0) / 2**20:.0f} MiB (sync / async)",
         max(o.get("sync save: host RSS", 0), o.get("async save, blocking: host RSS", 0)) <= 64 << 20),
        ("every async row at least even with DCP's best staging", ", ".join(
            f"{k.split(', ')[1]} {o[k] / b[k]:.2f}x" for k in ("async save, blocking", "async save, copied",
                                                                "async save, committed")),
         all(o[k] <= b[k] for k in ("async save, blocking", "async save, copied", "async save, committed"))),
    ]  # fmt: skip
    if "GPU memory" in " ".join(o):
        worst = max(v for k, v in o.items() if k.endswith("GPU memory"))
        out.append(("GPU memory growth during a save or load <= 64 MiB", f"{worst / 2**20:.0f} MiB", worst <= 64 << 20))
    if "slowdown" in r["loop"]:
        slow = r["loop"]["slowdown"]
        out.append(("steps with a save in flight <= 1.10x steps without", f"{slow:.2f}x", slow <= 1.10))
    return out


def markdown(r: dict[str, Any], meta: dict[str, Any]) -> str:
    f, o, d, b = r["floors"], r["ours"], r["dcp"], r["dcp best staging"]
    lines = [f"# Checkpoints on {meta['device']}", "", f"`{meta['command']}`; {meta['model']}; state "
             f"{r['state bytes'] / GiB:.2f} GiB; medians of {meta['repeats']} rounds after a warm-up; {meta['when']}.",
             "", "| row | ours | floor | DCP | DCP best staging | ours / floor | ours / DCP | ours / DCP best |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    floor_of = {"sync save": f["sync save"], "load": f["load"], "async save, copied": f["pinned copy"]}
    for row in ("sync save", "load", "async save, blocking", "async save, copied", "async save, committed"):
        fl, dv, bv = floor_of.get(row), d.get(row), b.get(row)
        cells = [f"{o[row] * 1e3:.1f} ms", f"{fl * 1e3:.1f} ms" if fl else "", f"{dv * 1e3:.1f} ms" if dv else "",
                 f"{bv * 1e3:.1f} ms" if bv else "", f"{o[row] / fl:.2f}x" if fl else "",
                 f"{o[row] / dv:.2f}x" if dv else "", f"{o[row] / bv:.2f}x" if bv else ""]  # fmt: skip
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| memory growth (largest of the later rounds) | ours | DCP | DCP best staging |",
        "|---|---|---|---|",
    ]
    for key in sorted(k for k in o if k.endswith(("host RSS", "GPU memory"))):
        cells = [f"{src[key] / 2**20:.0f} MiB" if key in src else "" for src in (o, d, b)]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", f"Training loop, an async save every 10 steps: {json.dumps(r['loop'])}", "", "| target | measured | met |",
              "|---|---|---|"]  # fmt: skip
    lines += [f"| {what} | {got} | {'yes' if ok else '**miss**'} |" for what, got, ok in targets(r)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the CPU mode (the default without CUDA)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up round")
    parser.add_argument("--dir", default="/dev/shm/fsdp_optim_gpu_bench", help="checkpoint directory (tmpfs)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    config = _config(args)
    os.makedirs(config.directory, exist_ok=True)
    _join(config)
    try:
        result = measure(config)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(config.directory, ignore_errors=True)
    device = torch.cuda.get_device_name(0) if config.on_gpu else f"the CPU ({os.cpu_count()} cores, {platform.node()})"
    meta = {"device": device, "command": "python -m benchmarks.gpu" + (" --small" if not config.on_gpu else ""),
            "model": f"{config.layers} x Linear({config.dim}, {config.dim}) nested, Adam, W=1",
            "repeats": config.repeats, "when": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__}  # fmt: skip
    text = markdown(result, meta)
    print(text)
    name = "gpu_staging" if config.on_gpu else "gpu_staging_small"
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "result": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
