"""The GPU benchmark's rows, targets and page: a function of the rows and meta alone, so that the stored JSON
re-renders its stored ``.md``."""

from __future__ import annotations

from typing import Any

from ..report import Report, Row, verdict

GiB = 1 << 30
SLOT_BYTES = 32 << 20  # fsdp_optim.job.stager.SLOT_BYTES: one slot of the pinned ring
WHOLE_ASYNC = "async save, whole"  # rows.WHOLE_ASYNC: memory from the call until the save is committed
PEERS = ("ours", "dcp", "dcp best staging")
TIMED = ("sync save", "load", "async save, blocking", "async save, copied", "async save, committed")
NCCL = ("async save, blocking (NCCL group, after a step)", "async save, blocking (NCCL group, GPU idle)")  # GPU only
FLOOR_OF = {"sync save": "sync save", "load": "load", "async save, copied": "pinned copy"}  # row -> its floor
ASYNC = ("async save, blocking", "async save, copied", "async save, committed")
LOOP = "training loop with async saves"  # earlier results: "training loop, an async save every 10 steps"


def _loop(at: dict[str, Row]) -> Row:
    return next(row for name, row in at.items() if name.startswith("training loop"))


def rows_of(model: str, floors: dict[str, float], peers: dict[str, dict[str, float]], loop: dict[str, Any]) -> list[Row]:
    """One row per timed operation (seconds of ours, its floor and each DCP; ours alone for an NCCL row), per memory
    growth (bytes), and the loop."""
    def row(name: str, **more: Any) -> Row:
        return {"model": model, "world_size": 1, "row": name, **{p: peers[p][name] for p in PEERS if name in peers.get(p, {})}, **more}

    memory = sorted(k for k in peers["ours"] if k.endswith(("host RSS", "GPU memory")))
    timed = [row(r, **({"floor": floors[FLOOR_OF[r]]} if FLOOR_OF.get(r) in floors else {})) for r in TIMED]
    timed += [row(r) for r in NCCL if r in peers["ours"]]
    return timed + [row(k) for k in memory] + [{"model": model, "world_size": 1, "row": LOOP, **loop}]


def targets(rows: list[Row]) -> list[Row]:
    """The issue's targets, each with its verdict."""
    at = {r["row"]: r for r in rows}
    o = lambda row: at[row]["ours"]  # noqa: E731
    model = rows[0]["model"]

    def check(name: str, value: float, limit: float, detail: str) -> Row:
        return verdict(name, model, 1, value, limit, value <= limit, detail)

    def ratio(name: str, row: str, versus: str, limit: float) -> Row:
        if versus not in at[row]:  # a partial run's results: not measured yet
            return verdict(name, model, 1, None, limit, None, "not measured")
        return check(name, o(row) / at[row][versus], limit, f"{o(row) * 1e3:.1f} ms vs {at[row][versus] * 1e3:.1f} ms")

    sync_rss, async_rss = (at.get(f"{r}: host RSS", {}).get("ours", 0) / 2**20 for r in ("sync save", WHOLE_ASYNC))
    best = {k.split(", ")[1]: o(k) / at[k]["dcp best staging"] for k in ASYNC if "dcp best staging" in at[k]}
    out = [
        check("async save blocking <= 50 ms", o("async save, blocking") * 1e3, 50, f"{o('async save, blocking') * 1e3:.1f} ms"),
        ratio("async copy done <= 1.2x pinned copy floor", "async save, copied", "floor", 1.2),
        ratio("sync save <= 1.15x floor", "sync save", "floor", 1.15),
        ratio("sync save <= 0.5x DCP", "sync save", "dcp", 0.5),
        ratio("load <= 1.15x floor", "load", "floor", 1.15),
        ratio("load <= 0.5x DCP", "load", "dcp", 0.5),
        check("host RSS growth of a later save <= 64 MiB", max(sync_rss, async_rss), 64,
              f"{sync_rss:.0f} / {async_rss:.0f} MiB (sync / async, the whole save: its background copy and write too)"),
    ]
    name = "every async row at least even with DCP's best staging"
    if best:
        out.append(check(name, max(best.values()), 1.0, ", ".join(f"{k} {v:.2f}x" for k, v in best.items())))
    else:
        out.append(verdict(name, model, 1, None, 1.0, None, "not measured"))
    out += _gpu_memory(at)
    if NCCL[0] in at:
        nccl = o(NCCL[0]) * 1e3
        out.append(check("async save blocking, NCCL group, after a step <= 50 ms", nccl, 50, f"{nccl:.1f} ms (GPU idle: {o(NCCL[1]) * 1e3:.1f} ms)"))
    loop = _loop(at)
    if "slowdown" in loop:
        fit = f", {loop['saves that fit']} of {loop['saves']} saves done within their {loop['every']} steps" if "every" in loop else ""
        theirs = f"; DCP {loop['dcp: slowdown']:.2f}x, measured the same way" if "dcp: slowdown" in loop else "; DCP not measured"
        worst = f"; worst step {loop['worst slowdown']:.2f}x (DCP {loop.get('dcp: worst slowdown', float('nan')):.2f}x)"
        out.append(check("steps with a save in flight <= 1.10x steps without", loop["slowdown"], 1.10, f"{loop['slowdown']:.2f}x{fit}{theirs}{worst}"))
    return out


def _gpu_memory(at: dict[str, Row]) -> list[Row]:
    """GPU memory growth of a save (<= 64 MiB) and of a load (<= a ring slot + 64 MiB; on the CPU, stand-ins)."""
    model, out = next(iter(at.values()))["model"], []
    saves = [at[f"{r}: GPU memory"]["ours"] / 2**20 for r in ("sync save", "async save, blocking", WHOLE_ASYNC) if f"{r}: GPU memory" in at]
    if saves:
        out.append(verdict("GPU memory growth of a save <= 64 MiB", model, 1, max(saves), 64, max(saves) <= 64, f"{max(saves):.0f} MiB"))
    if "load: GPU memory" in at:
        grown, limit = at["load: GPU memory"]["ours"] / 2**20, (SLOT_BYTES >> 20) + 64
        out.append(verdict(f"GPU memory growth of a load <= a ring slot + 64 MiB ({limit} MiB)", model, 1, grown, limit, grown <= limit, f"{grown:.0f} MiB"))
    return out


def _ms(row: Row, key: str) -> str:
    return f"{row[key] * 1e3:.1f} ms" if key in row else ""


def _x(row: Row, key: str) -> str:
    return f"{row['ours'] / row[key]:.2f}x" if key in row else ""


def markdown(rows: list[Row], meta: dict[str, Any], png_name: str | None = None) -> str:
    at = {r["row"]: r for r in rows}
    loop_row = _loop(at)
    loop = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in loop_row.items() if k not in ("model", "world_size", "row")}
    rep = Report(f"Checkpoints on {meta['device']}", meta).add(
        f"Command: `{meta['command']}`; {meta['model']}; state {meta['state_bytes'] / GiB:.2f} GiB; medians of {meta['repeats']} rounds "
        f"after a warm-up; wall time {meta['wall_s'] / 60:.1f} min; load average before/after: {meta['load_before']} / {meta['load_after']}.",
        f"Package measured: {meta['package']}. Host RSS: peak growth during the call (VmHWM minus VmRSS before it); GPU memory: "
        "peak allocated minus allocated before it; both the largest of the later rounds.",
        "",
    )
    if meta.get("partial"):
        rep.add(f"**Partial results**: written as the run went, {meta['partial']}; it ended before the rest.", "")
    rep.targets(targets(rows), "## Targets")
    rep.add("## Rows", "").table(
        ["row", "ours", "floor", "DCP", "DCP best staging", "ours / floor", "ours / DCP", "ours / DCP best"],
        [[r] + [_ms(at[r], k) for k in ("ours", "floor", "dcp", "dcp best staging")] + [_x(at[r], k) for k in ("floor", "dcp", "dcp best staging")] for r in (*TIMED, *NCCL) if r in at],
    )
    memory = [r for r in rows if r["row"].endswith(("host RSS", "GPU memory"))]
    rep.table(["memory growth", "ours", "DCP", "DCP best staging"], [[r["row"]] + [f"{r[p] / 2**20:.0f} MiB" if p in r else "" for p in PEERS] for r in memory])
    name = loop_row["row"]
    return rep.add(f"{name[0].upper() + name[1:]}: " + (", ".join(f"{k} {v}" for k, v in loop.items()) or "not measured") + ".", "").text()
