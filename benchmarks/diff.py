"""``diff`` against reading both sources: what comparing costs on top of the reading it cannot avoid.

    python -m benchmarks.diff [--layers N] [--dim D] [--repeat R] [--threads T] [--workdir DIR] [--json FILE]

A synthetic Adam state (``LAYERS`` parameters of ``DIM x DIM`` fp32 with ``exp_avg``, ``exp_avg_sq`` and a 0-dim
``step``: 32 x 1024^2 = 33.6M parameters, 256 MiB of state per source) is written as a full dict, then offline
as three sources of the same state: ``a``, a sharded checkpoint at world size 4 with two layers per FSDP unit;
``b``, a sharded checkpoint at world size 3 with one layer per unit; ``named``, a named safetensors file; and
``b_off``, ``b`` with every ``exp_avg_sq`` element one ULP up (every tensor differs: the slow path).

Rows, each timed ``--repeat`` times after one untimed warm-up round (the page cache warm), interleaved, median
reported, with the peak RSS growth of the last run:

- ``read a + b``: the floor: both sources opened and planned as ``diff`` does, every (parameter, key) tensor of
  each made (one of each side at a time, as ``diff`` makes them) and dropped, nothing compared;
- ``diff a b``: ``fsdp_optim.diff`` of the same pair; the ratio is the row over its floor.

``--threads`` (default 1) sets torch's intra-op threads for both rows: on a small shared machine, threads that
wait for each other at every parallel region make timings of either row mostly noise.

Target: ``diff`` of equal sources <= 1.2 x its floor. The pairs: ``a`` / ``b`` (equal), ``a`` / ``named`` (equal)
and ``a`` / ``b_off`` (every tensor different).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from .peak import MiB, adam_full_dict, layers, measured

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--repeat", type=int, default=REPEAT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="diff_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "b_off").exists():
        _make(work, args.layers, args.dim)
    rows = _run(work, args.repeat)
    params = args.layers * args.dim * args.dim
    state = params * 2 * 4
    print(f"state: {args.layers} params of {args.dim}x{args.dim} fp32 ({params / 1e6:.1f}M), Adam: "
          f"{state / MiB:,.0f} MiB per source; largest tensor {args.dim * args.dim * 4 / MiB:.0f} MiB; "
          f"median of {args.repeat}, {args.threads} torch thread(s)")  # fmt: skip
    print(f"{'pair':<24} {'equal':>6} {'read s':>8} {'diff s':>8} {'ratio':>6} {'read peak MiB':>14} {'diff peak MiB':>14}")
    for r in rows:
        print(f"{r['pair']:<24} {r['equal']!s:>6} {r['read_s']:>8.3f} {r['diff_s']:>8.3f} {r['ratio']:>6.2f} "
              f"{r['read_peak'] / MiB:>14.0f} {r['diff_peak'] / MiB:>14.0f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": args.layers, "dim": args.dim, "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
