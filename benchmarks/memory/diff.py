"""``diff`` against reading both sources (``python -m benchmarks.memory diff``): what comparing costs on top of the
reading it cannot avoid.

A synthetic Adam state (``LAYERS`` x ``DIM``^2 fp32: 256 MiB per source), written offline as ``a`` (sharded, W=4,
two layers per unit), ``b`` (sharded, W=3, one layer per unit), ``named.safetensors`` and ``b_off`` (``b`` with
every ``exp_avg_sq`` element one ULP up: the slow path). Rows, in this process with one torch thread, timed
``--repeat`` times after a warm-up round, interleaved, median (peak RSS growth of the last run): ``read a b`` (the
floor: every tensor of both made as ``diff`` makes them and dropped) and ``diff a b``. Target: ``diff`` of equal
sources <= 1.2x its floor.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from ..peak import MiB, adam_full_dict, layers, measured

LAYERS, DIM, REPEAT = 32, 1024, 5


def _make(work: Path, count: int, dim: int) -> None:
    """``full.pt`` and the sources ``a``, ``b``, ``named.safetensors``, ``b_off`` (see the module docstring)."""
    import torch

    import fsdp_optim
    from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec

    shapes = layers(count, dim)
    names = list(shapes)
    full = adam_full_dict(shapes, 4, eps=1e-8, weight_decay=0.0)
    torch.save(full, work / "full.pt")

    def layout(per_unit: int, world_size: int) -> ModelLayout:
        specs = lambda u: tuple(ParamSpec(n, (dim, dim), k * dim * dim) for k, n in enumerate(names[u : u + per_unit]))  # noqa: E731
        flats = tuple(FlatParamLayout(f"layers.{u}", specs(u), world_size, 0, torch.float32, True) for u in range(0, count, per_unit))
        return ModelLayout(flats, tuple(names), world_size, 0)

    fsdp_optim.reshard(full, 4, work / "a", layout=layout(2, 4))
    fsdp_optim.reshard(full, 3, work / "b", layout=layout(1, 3))
    fsdp_optim.to_safetensors(full, work / "named.safetensors")
    for entries in full["state"].values():
        entries["exp_avg_sq"] = torch.nextafter(entries["exp_avg_sq"], torch.tensor(2.0))
    fsdp_optim.reshard(full, 3, work / "b_off", layout=layout(1, 3))


def read_both(a: Path, b: Path) -> int:
    """The floor of ``diff a b``: every tensor of both made as ``diff`` makes them, nothing compared."""
    import contextlib

    from fsdp_optim.offline.per_param import PerParameter
    from fsdp_optim.offline.sources import open_source

    made = 0
    with contextlib.ExitStack() as stack:
        va, vb = (PerParameter.of(stack.enter_context(open_source(p))) for p in (a, b))
        for name in va.names:
            for key, entry in va.entries(name).items():
                if entry.kind.value == "scalar":  # scalars come from the plan
                    continue
                ta = va.tensor(name, key)
                tb = vb.tensor(name, key)
                made += ta.numel() + tb.numel()
                del ta, tb
    return made


def _run(work: Path, repeat: int) -> list[dict[str, Any]]:
    import fsdp_optim

    pairs = [("a", "b"), ("a", "named.safetensors"), ("a", "b_off")]
    ops = {
        f"{kind} {a} {b}": (lambda a=a, b=b, kind=kind: read_both(work / a, work / b) if kind == "read"
                            else fsdp_optim.diff(work / a, work / b))
        for a, b in pairs
        for kind in ("read", "diff")
    }  # fmt: skip
    for fn in ops.values():  # warm-up: the page cache holds every file
        fn()
    times: dict[str, list[float]] = {op: [] for op in ops}
    growth: dict[str, int] = {}
    equal: dict[str, bool] = {}
    for _ in range(repeat):
        for op, fn in ops.items():
            seconds, grown, result = measured(fn)
            times[op].append(seconds)
            growth[op] = grown
            if op.startswith("diff"):
                equal[op] = result.equal
    rows = []
    for a, b in pairs:
        floor, ours = f"read {a} {b}", f"diff {a} {b}"
        rows.append({
            "pair": f"{a} / {b}", "equal": equal[ours], "read_s": statistics.median(times[floor]),
            "diff_s": statistics.median(times[ours]), "read_peak": growth[floor], "diff_peak": growth[ours],
            "ratio": statistics.median(times[ours]) / statistics.median(times[floor]),
        })  # fmt: skip
    return rows


def run(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # on a small shared machine, threads waiting for each other make either row noise
    count, repeat = args.layers or (2 if args.small else LAYERS), args.repeat or (1 if args.small else REPEAT)
    if not (work / "b_off").exists():
        _make(work, count, DIM)
    rows = _run(work, repeat)
    params = count * DIM * DIM
    print(f"state: {count} params of {DIM}x{DIM} fp32 ({params / 1e6:.1f}M), Adam: {params * 8 / MiB:,.0f} MiB per source; "
          f"largest tensor {DIM * DIM * 4 / MiB:.0f} MiB; median of {repeat}, 1 torch thread(s)")  # fmt: skip
    print(f"{'pair':<24} {'equal':>6} {'read s':>8} {'diff s':>8} {'ratio':>6} {'read peak MiB':>14} {'diff peak MiB':>14}")
    for r in rows:
        print(f"{r['pair']:<24} {r['equal']!s:>6} {r['read_s']:>8.3f} {r['diff_s']:>8.3f} {r['ratio']:>6.2f} "
              f"{r['read_peak'] / MiB:>14.0f} {r['diff_peak'] / MiB:>14.0f}")  # fmt: skip
    return {"layers": count, "dim": DIM, "threads": 1, "rows": rows}
