"""The offline and planning measurements of ``benchmarks.scale``: synthetic layouts, our operations, their floors.

Every timed operation runs in a forked child (``peak.in_child``) that reports its wall time and its peak RSS
growth (``VmHWM``, reset at the start, minus the RSS it started with), so one operation's memory never
hides another's.

- A checkpoint of ``units`` FSDP units at world size ``W`` is made by resharding a full dict (Adam:
  ``exp_avg``, ``exp_avg_sq`` per parameter, ``step``): each unit holds ``per_unit`` float32 elements (a
  weight and a bias), so the state per rank is tiny and the cost is the bookkeeping, not the bytes.
- Floors (``floor_reshard``, ``floor_consolidate``): read every rank file with the plain loader
  (``safetensors.torch.load_file``; ``torch.load`` for format-1 files), copy every element once into ``W'``
  equal buffers (or one), and write each as a safetensors file of one tensor, as a format-2 rank file is,
  with an ``fsync`` per file. No checks, no checksums, no manifest, no staging, no re-cutting per unit.
- Planning (:func:`plan_one_rank`): a manifest's dict parsed and checked (``Manifest.from_dict``), one plan
  against the same units re-cut for ``3W/4`` ranks, then one rank's reads and the saved ranks they touch.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from fsdp_optim.cli import main as cli_main
from fsdp_optim.core.execute import rank_reads, saved_ranks
from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import plan
from fsdp_optim.core.records import GroupRecord, StateEntry
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import Manifest, manifest_source

from ..ckpt.floors import into_parts
from ..peak import adam_full_dict, fsync_path

KEYS = ("exp_avg", "exp_avg_sq")
BIAS = 16


def layout(units: int, world_size: int, per_unit: int) -> ModelLayout:
    """``units`` flattened units ``u{k}`` (``u{k}.w``: per_unit - 16 elements, ``u{k}.b``: 16) over ``world_size``."""
    flats, names = [], []
    for u in range(units):
        w, b = ParamSpec(f"u{u}.w", (per_unit - BIAS,), 0), ParamSpec(f"u{u}.b", (BIAS,), per_unit - BIAS)
        flats.append(FlatParamLayout(f"u{u}", (w, b), world_size, 0, torch.float32, True))
        names += [w.name, b.name]
    return ModelLayout(tuple(flats), tuple(names), world_size, 0)


def full_dict(lay: ModelLayout) -> dict[str, Any]:
    """Adam's full dict for ``lay``: random ``exp_avg`` / ``exp_avg_sq``, ``step`` 3."""
    return adam_full_dict({p.name: p.shape for f in lay.flat_params for p in f.params}, lay.world_size, step=3.0)


def manifest(units: int, world_size: int, per_unit: int) -> Manifest:
    """The manifest such a checkpoint has (no files): what a reader of one rank parses and plans from."""
    entries = (
        *(StateEntry(k, StateKind.SHARDED, dtype="float32") for k in KEYS),
        StateEntry("step", StateKind.SCALAR, value=torch.tensor(3.0)),
    )
    return Manifest.from_layout(
        layout(units, world_size, per_unit),
        save_id="0" * 32,
        optimizer="Adam",
        state=dict.fromkeys(range(units), entries),
        groups=(GroupRecord({"lr": 1e-3}, tuple(range(units))),),
    )


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def inspect(directory: Path) -> int:
    """``fsdp-optim inspect DIR --units``: its output lines (what a user reads at this scale)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["inspect", str(directory), "--units"])
    assert code == 0, out.getvalue()[-400:]
    return len(out.getvalue().splitlines())


# ---------------------------------------------------------------------------------------------------
# Floors


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    safetensors.torch.save_file(tensors, str(path))
    fsync_path(path)


def _read_all(files: list[Path]) -> list[torch.Tensor]:
    """Every tensor of every rank file, read into memory with the plain loaders (no checks, no checksums)."""
    out: list[torch.Tensor] = []
    for path in files:
        if path.suffix == ".safetensors":
            out += safetensors.torch.load_file(str(path)).values()
        else:
            payload = torch.load(path, mmap=True, weights_only=True)
            out += [v.clone() for e in payload["state"].values() for v in e.values() if torch.is_tensor(v) and v.dim()]
    return out


def _write_parts(tensors: list[torch.Tensor], parts: int, out: Path, name: str) -> None:
    """Copy the tensors' elements once, as one stream, into ``parts`` equal buffers; write each (one tensor a
    file, as a format-2 rank file holds one tensor per dtype) with an fsync."""
    out.mkdir(parents=True, exist_ok=True)
    for k, buf in enumerate(into_parts(tensors, parts, sum(t.numel() for t in tensors))):
        _write_safetensors({"float32": buf}, out / f"{name}{k}.safetensors")


def floor_reshard(files: list[Path], new_size: int, out: Path) -> None:
    """Read every rank file, write ``new_size`` files of the same bytes, fsync each."""
    _write_parts(_read_all(files), new_size, out, "rank")


def floor_recut(src: Path, new_size: int, out: Path) -> None:
    """The least a format-2 reshard must do: the manifest read as plain JSON (no checks), every rank file read
    with the plain loader, each (unit, key) re-cut for every output rank (the slices of the saved shards that
    overlap it, found by arithmetic), each output rank's shards written as one tensor, fsync each file."""
    body = json.loads((src / "manifest.json").read_text())["body"]
    numel = [f["numel"] for f in body["flat_params"]]
    world_size = body["world_size"]
    files = {f["rank"]: safetensors.torch.load_file(str(src / f["file"])) for f in body["files"]}
    # Format 3: shards in (unit, key) order, each ceil(numel / W) elements, the same offsets in every file.
    order = sorted((u, e["key"]) for u, f in enumerate(body["flat_params"]) for e in f["state"] if e["kind"] == "sharded")
    offsets = [0]
    for u, _ in order:
        offsets.append(offsets[-1] + -(-numel[u] // world_size))
    where = {(r, u, k): ("float32", offsets[i]) for r in files for i, (u, k) in enumerate(order)}
    index = ShardIndex(tuple(numel), (world_size,) * len(numel), (False,) * len(numel))
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(new_size):
        parts = []
        for u, key in order:
            c, saved_c = -(-numel[u] // new_size), -(-numel[u] // world_size)
            shard = torch.zeros(c)
            for saved, lo, hi in index.pieces(u, min(rank * c, numel[u]), min((rank + 1) * c, numel[u])):
                name, offset = where[(saved, u, key)]
                first = offset + lo - saved * saved_c
                shard[lo - rank * c : hi - rank * c].copy_(files[saved][name][first : first + hi - lo])
            parts.append(shard)
        _write_safetensors({"float32": torch.cat(parts)}, out / f"rank{rank}.safetensors")


def floor_consolidate(files: list[Path], out: Path) -> None:
    """Read every rank file, write one file of the same bytes, fsync it."""
    _write_parts(_read_all(files), 1, out, "full")


# ---------------------------------------------------------------------------------------------------
# Planning one rank


def plan_one_rank(units: int, world_size: int, per_unit: int, *, from_file: Path | None = None, traced: bool = True) -> dict[str, Any]:
    """Parse + check a manifest (its dict, or the checkpoint ``from_file``'s as written), plan a re-cut to ``3W/4``,
    plan one rank.

    Returns seconds per phase (untraced) and, with ``traced``, tracemalloc's peak over a second run.
    """
    body = manifest(units, world_size, per_unit).to_dict() if from_file is None else None
    rank = world_size // 3  # a rank with real elements in every unit, away from the edges

    def phases() -> dict[str, float]:
        t0 = time.perf_counter()
        m = read_manifest(from_file) if from_file is not None else Manifest.from_dict(body, source="manifest")
        t1 = time.perf_counter()
        the_plan = plan(manifest_source(m, "ckpt", lambda *a: None), m.with_world_size(world_size * 3 // 4).layout(0))
        t2 = time.perf_counter()
        reads = rank_reads(the_plan, rank)
        files = saved_ranks(the_plan, rank)  # (it finds the reads again, as a load does)
        t3 = time.perf_counter()
        assert reads and files, (units, world_size)
        return {"read_s": t1 - t0, "plan_s": t2 - t1, "rank_s": t3 - t2, "files": len(files), "reads": len(reads)}

    phases()  # warm-up: first calls pay one-time costs (lazy imports, caches)
    timed = phases()
    out: dict[str, Any] = {**timed, "total_s": timed["read_s"] + timed["plan_s"] + timed["rank_s"]}
    if traced:
        tracemalloc.start()
        phases()
        out["peak_traced"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out
