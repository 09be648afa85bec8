"""Where our sharded save and load spend their time: cProfile on every rank, grouped into what can be sped up.

    python -m benchmarks.ckpt.profile                        # 25M model, W = 2, 3 calls of each
    python -m benchmarks.ckpt.profile --model 100M --calls 2

Each rank trains the model (fsdp_optim's FSDP, Adam), warms every path up once, then profiles ``calls``
sync saves, ``calls`` loads into fresh optimizers from the same world size, and ``calls`` loads from a
checkpoint cut for another world size (``reshard``, untimed, so the load re-cuts shards), plus the
floors of ``floors.py`` for scale. Time is split at function boundaries that do not nest in one another:
checksums (``core/checksums.py`` entered from outside it), ``torch.save`` / ``torch.load``, ``fsync``, collectives
(``job/transport.py`` entered from outside it, including the wait for slower ranks), the manifest
(``formats/sharded/manifest*.py``), ``optim.state_dict()`` / ``optim.load_state_dict``, tensor copies
(``clone``/``copy_`` called by fsdp_optim), and the rest. Page faults are counted (``getrusage``) and priced by timing the first touch
of fresh memory in the same process; they happen inside the other categories (an estimate, not a slice).
Writes ``<out>/checkpoint_profile.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import cProfile
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import models, spawn
from ..checkpoint import STORAGE
from ..host import storage
from ..measure import release_memory
from ..registry import RESULTS
from ..report import table
from . import floors as ckpt_floors

PAGE = resource.getpagesize()
# (label, how to find it): ("cum", file suffix, function) = inclusive time of that function;
# ("tot", name) = exclusive time of a built-in; ("from", file suffix) = inclusive time of that file's functions
# entered from outside it; ("called_by_pkg", name) = a built-in's time when fsdp_optim called it.
# The modules whose time each category counts (entered from outside them); tests/test_benchmarks_tree.py checks
# that every path named here exists, so a moved module cannot silently read 0.
MANIFEST = ("fsdp_optim/formats/sharded/manifest.py", "fsdp_optim/formats/sharded/manifest_json.py")
CATEGORIES = (
    ("checksums (xxh3, core/checksums.py)", ("from", ("fsdp_optim/core/checksums.py",))),
    ("torch.save (pickle + write)", ("cum", "torch/serialization.py", "save")),
    ("torch.load (read + unpickle)", ("cum", "torch/serialization.py", "load")),
    ("fsync", ("tot", "<built-in method posix.fsync>")),
    ("collectives (job/transport.py, incl. waits)", ("from", ("fsdp_optim/job/transport.py",))),
    ("manifest (formats/sharded/manifest*.py)", ("from", MANIFEST)),
    ("optim.state_dict()", ("cum", "torch/optim/optimizer.py", "state_dict")),
    ("optim.load_state_dict()", ("cum", "torch/optim/optimizer.py", "load_state_dict")),
    ("tensor copies by fsdp_optim", ("called_by_pkg", ("clone", "copy_", "contiguous", "cat", "zeros", "empty"))),
)


def _seconds(stats: dict[Any, Any], how: tuple[Any, ...]) -> float:
    kind = how[0]
    total = 0.0
    for (file, _, name), (_, _, tt, ct, callers) in stats.items():
        if kind == "cum" and file.endswith(how[1]) and name == how[2]:
            total += ct
        elif kind == "tot" and name == how[1]:
            total += tt
        elif kind == "from" and file.endswith(how[1]):  # str.endswith takes the tuple of paths
            total += sum(c[3] for k, c in callers.items() if not k[0].endswith(how[1]))
        elif kind == "called_by_pkg" and file == "~" and any(f"'{op}'" in name or name.endswith(f".{op}>") for op in how[1]):
            total += sum(c[2] for k, c in callers.items() if "fsdp_optim/" in k[0])
    return total


def _fault_cost() -> float:
    """Seconds per minor page fault: first touch of fresh memory minus a second touch."""
    n = 64 << 20
    release_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    buf = torch.empty(n, dtype=torch.uint8)
    buf.fill_(1)
    fresh = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    start = time.perf_counter()
    buf.fill_(2)
    warm = time.perf_counter() - start
    return max(fresh - warm, 0.0) / max(faults, 1)


def _profile(call: Callable[[], Any], calls: int, prepare: Callable[[], None] | None = None) -> dict[str, Any]:
    prof = cProfile.Profile()
    wall = 0.0
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        if prepare is not None:
            prepare()
        release_memory()
        dist.barrier()
        start = time.perf_counter()
        prof.enable()
        result = call()
        prof.disable()
        wall += time.perf_counter() - start
        del result
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    prof.create_stats()
    stats = prof.stats  # type: ignore[attr-defined]
    parts = {label: _seconds(stats, how) / calls for label, how in CATEGORIES}
    top = sorted(
        ((tt, f"{Path(f).name}:{line}({name})") for (f, line, name), (_, _, tt, _, _) in stats.items()), reverse=True
    )[:8]
    return {
        "wall_s": wall / calls,
        "parts_s": parts,
        "user_s": (usage1.ru_utime - usage0.ru_utime) / calls,
        "sys_s": (usage1.ru_stime - usage0.ru_stime) / calls,
        "minflt": (usage1.ru_minflt - usage0.ru_minflt) / calls,
        "top_tottime": [(round(t / calls, 4), name) for t, name in top],
    }


def run(rank: int, world_size: int, spec: models.ModelSpec, calls: int, root: str) -> dict[str, Any]:
    import fsdp_optim

    model = models.wrap_fairscale(spec, torch.device("cpu"))
    optim = models.train(model, spec, 2, rank, torch.device("cpu"))
    optim.zero_grad(set_to_none=True)
    same, other, floor = Path(root) / "same", Path(root) / "other", Path(root) / "floor"
    floor.mkdir(parents=True, exist_ok=True)
    fresh: list[torch.optim.Optimizer] = []

    def prepare() -> None:
        fresh[:] = [torch.optim.Adam(model.parameters(), lr=models.LR)]

    def load(directory: Path) -> Callable[[], Any]:
        return lambda: fsdp_optim.load_sharded_optim_state(model, fresh.pop(), directory)

    ops: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]] = {
        "ours save": (lambda: fsdp_optim.save_sharded_optim_state(model, optim, same), None),
        "floor save": (lambda: ckpt_floors.save(optim.state_dict(), floor, rank), None),
        "ours load, same W": (load(same), prepare),
        "ours load, other W": (load(other), prepare),
        "floor load": (lambda: ckpt_floors.load(ckpt_floors.rank_file(floor, rank)), None),
    }
    for name, (call, before) in ops.items():  # warm-up, and the checkpoints the loads read
        if before is not None:
            before()
        call()
        if name == "ours save" and rank == 0:
            fsdp_optim.reshard(same, world_size + 1, other)
        dist.barrier()
    out = {"fault_cost_s": _fault_cost(), "state_bytes": sum(
        v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if torch.is_tensor(v)
    )}
    for name, (call, before) in ops.items():
        out[name] = _profile(call, calls, before)
    return out


def _millis(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def markdown(results: list[dict[str, Any]], spec: models.ModelSpec, world_size: int, calls: int, storage: str) -> str:
    ops = [k for k in results[0] if isinstance(results[0][k], dict)]
    lines = [
        f"# Where our checkpoint time goes ({spec.name} model, W={world_size}, {storage})",
        "",
        f"`python -m benchmarks.ckpt.profile --model {spec.name} --world-size {world_size} --calls {calls}`: cProfile "
        f"on every rank, mean of {calls} calls after one warm-up; rank state {results[0]['state_bytes'] / 2**20:,.0f} MiB. "
        "Milliseconds per call (share of the call's wall time); categories do not nest, `rest` is what no "
        "category covers. Page faults happen inside the categories above them (an estimate from "
        f"{results[0]['fault_cost_s'] * 1e6:.2f} µs per fault, measured here).",
        "",
    ]

    def cells(value: Callable[[dict[str, Any], dict[str, Any]], str]) -> list[str]:
        return [value(res[op], res) for op in ops for res in results]

    body = [["wall", *cells(lambda p, _: f"**{_millis(p['wall_s'])}**")]]
    body += [[label, *cells(lambda p, _, k=label: _share(p["parts_s"][k], p["wall_s"]))] for label, _ in CATEGORIES]
    body += [["rest", *cells(lambda p, _: _share(p["wall_s"] - sum(p["parts_s"].values()), p["wall_s"]))]]
    body += [["CPU user / sys", *cells(lambda p, _: f"{_millis(p['user_s'])} / {_millis(p['sys_s'])}")]]
    body += [["minor page faults: count, est. ms", *cells(lambda p, r: f"{p['minflt']:,.0f}, {_share(p['minflt'] * r['fault_cost_s'], p['wall_s'])}")]]
    lines += table(["", *(f"{op} (rank {r})" for op in ops for r in range(len(results)))], body)
    lines += ["", "Largest exclusive times (rank 0), ms per call:", ""]
    for op in ops:
        top = ", ".join(f"{name} {t * 1e3:.0f}" for t, name in results[0][op]["top_tottime"][:6])
        lines.append(f"- {op}: {top}")
    return "\n".join(lines) + "\n"


def _share(seconds: float, wall: float) -> str:
    return f"{_millis(seconds)} ({seconds / wall:.0%})" if wall > 0 else _millis(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ckpt.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="25M")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--dir", type=Path, default=STORAGE if STORAGE.is_dir() else Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    spec = models.parse_model(args.model)
    root = tempfile.mkdtemp(prefix="fsdp_optim_profile_", dir=args.dir)
    try:
        results = spawn.run_ranks(run, args.world_size, spec, args.calls, root, collective_timeout_s=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = markdown(results, spec, args.world_size, args.calls, storage(args.dir))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
