"""Format 1 (torch zip + pickle) against format 2 (JSON manifest + safetensors, byte-range reads): one run, offline.

Configuration at the top. For each model size, an Adam state at world size 2 (two float32 shards per
unit, ``step`` a scalar) is written in both formats and every operation is timed on each (median of
``REPEATS`` after ``WARMUP``, and the minimum, which the table shows: on a shared machine the least
disturbed run is the best estimate of the code's cost; page cache warm, files on tmpfs):

- ``save``: both rank files and the manifest, written one after the other, each atomically (fsync);
  format 1 as fsdp_optim wrote it before format 2 (``torch.save`` of the payload, ``atomic_save``).
- ``same-W load``: each rank's whole file into memory, verified (``ShardedCheckpoint.load_rank``: what a
  job at the saved layout does).
- ``other-W load``: every rank of a world-size-3 job cut from the files (``plan`` + ``cut_rank``).
- ``consolidate``: the full dict (``fsdp_optim.consolidate``).

and compared with the floor of its format, reading every file whole: ``torch.load(f, weights_only=True)``
of each format-1 file, ``safetensors.torch.load_file`` of each format-2 rank file with every tensor copied
into memory (``load_file`` maps the file; the copy reads it). ``bytes`` is the size on
disk; ``read/payload`` is the bytes a format-2 other-W load hashed (read) over the shards' bytes (which it copies).
Each result is checked bit for bit against the state written. Prints a table, writes JSON.

``python -m benchmarks.format2 [--quick] [--dir DIR] [--layout]``; ``--layout`` prints the rank-file
header measurement behind the per-dtype layout (see ``fsdp_optim/formats/sharded/segments.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from fsdp_optim import consolidate
from fsdp_optim.core.layout import FlatParamLayout, ModelLayout, ParamSpec
from fsdp_optim.core.plan import cut_rank, plan
from fsdp_optim.core.records import GroupRecord, state_entries
from fsdp_optim.disk.atomic import atomic_save
from fsdp_optim.formats.sharded.manifest import (
    LEGACY_MANIFEST_NAME,
    FileRecord,
    Manifest,
    shard_file_name,
)
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.torch_files import shard_payload, wrap
from fsdp_optim.formats.sharded.writer import write_manifest, write_shard_file

from .peak import rounds
from .report import SCRATCH

MODELS = {"25M": 25_000_000, "100M": 100_000_000}
UNITS = 24  # FSDP units per model (a transformer wrapped per block)
WORLD_SIZE, OTHER_WORLD_SIZE = 2, 3
WARMUP, REPEATS = 1, 5
QUICK = {"models": {"5M": 5_000_000}, "repeats": 2}
STORAGE = Path("/dev/shm")


def build(numel: int) -> tuple[Manifest, list[dict[int, dict[str, Any]]]]:
    """A world-size-2 Adam checkpoint of ``numel`` float32 parameters in ``UNITS`` units: manifest, rank states."""
    g = torch.Generator().manual_seed(0)
    per = numel // UNITS
    flats = tuple(
        FlatParamLayout(f"layers.{i}", (ParamSpec(f"layers.{i}.w", (per - 7,), 0), ParamSpec(f"layers.{i}.b", (7,), per - 7)),
                        WORLD_SIZE, None, torch.float32, True)
        for i in range(UNITS)
    )  # fmt: skip
    layout = ModelLayout(flats, tuple(p.name for f in flats for p in f.params), WORLD_SIZE, 0)
    ranks = []
    for r in range(WORLD_SIZE):
        shard = flats[0].at_rank(r).shard_numel
        ranks.append({
            i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(shard, generator=g), "exp_avg_sq": torch.rand(shard, generator=g)}
            for i in range(UNITS)
        })  # fmt: skip
    entries = {i: state_entries(flats[i].at_rank(0), ranks[0][i]) for i in range(UNITS)}
    groups = (GroupRecord({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, tuple(range(UNITS))),)
    manifest = Manifest.from_layout(layout, save_id="0f" * 16, optimizer="Adam", state=entries, groups=groups)
    return manifest, ranks


def save_v1(directory: Path, manifest: Manifest, ranks: list[dict[int, dict[str, Any]]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for r, state in enumerate(ranks):
        payload, checksum = shard_payload(state, save_id=manifest.save_id, rank=r, world_size=WORLD_SIZE)
        name = shard_file_name(manifest.save_id, r, WORLD_SIZE, version=1)
        records.append(FileRecord(r, name, checksum, atomic_save(payload, directory / name)))
    atomic_save(wrap("manifest", replace(manifest, version=1, files=tuple(records)).to_dict()), directory / LEGACY_MANIFEST_NAME)


def save_v2(directory: Path, manifest: Manifest, ranks: list[dict[int, dict[str, Any]]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    records = [write_shard_file(directory, s, save_id=manifest.save_id, rank=r, world_size=WORLD_SIZE) for r, s in enumerate(ranks)]
    write_manifest(directory, replace(manifest, files=tuple(records)))


def load_same(directory: Path) -> list[dict[int, dict[str, Any]]]:
    with ShardedCheckpoint(directory, lazy=True) as ckpt:
        return [ckpt.load_rank(r) for r in range(WORLD_SIZE)]


def load_other(directory: Path) -> tuple[list[dict[int, dict[str, Any]]], int]:
    """Every rank of a world-size-3 job cut from the files, and the bytes read (hashed) doing so."""
    with ShardedCheckpoint(directory) as ckpt:
        target = ckpt.manifest.with_world_size(OTHER_WORLD_SIZE)
        out = [cut_rank(plan(ckpt.source(), target.layout(r)), r, after_unit=ckpt.trim) for r in range(OTHER_WORLD_SIZE)]
        read = sum(f.file.bytes_verified for f in ckpt._files.values() if getattr(f, "file", None) is not None)
    return out, read


def floor_v1(directory: Path) -> None:
    for f in sorted(directory.iterdir()):
        torch.load(f, weights_only=True)


def floor_v2(directory: Path) -> None:
    for f in sorted(directory.glob("*.safetensors")):
        _ = {k: v.clone() for k, v in safetensors.torch.load_file(f).items()}  # load_file maps lazily: clone reads
    json.loads((directory / "manifest.json").read_bytes())


def timed(fn: Callable[[], Any], repeats: int, medians: dict[str, float], name: str) -> tuple[float, Any]:
    """The minimum time of ``repeats`` calls (after ``WARMUP``) and the last result; the median into ``medians``."""
    last: list[Any] = [None]  # only the last call's result stays alive

    def call() -> None:
        last[0] = fn()

    times = rounds({name: call}, warmup=WARMUP, repeats=repeats)[name]
    medians[name] = statistics.median(times)
    return min(times), last[0]


def check(name: str, manifest: Manifest, ranks: list[dict[int, dict[str, Any]]], same: Any, other: Any, full: Any) -> None:
    for r, state in enumerate(ranks):
        for i, entries in state.items():
            for key, value in entries.items():
                assert torch.equal(same[r][i][key], value) and same[r][i][key].dtype == value.dtype, f"{name}: same-W {r} {i} {key}"
    for i in range(UNITS):
        whole = torch.cat([ranks[r][i]["exp_avg"] for r in range(WORLD_SIZE)])
        cut = torch.cat([other[r][i]["exp_avg"] for r in range(OTHER_WORLD_SIZE)])
        n = manifest.flat_params[i].numel  # both without their padding
        assert torch.equal(cut[:n], whole[:n]), f"{name}: other-W unit {i}"
        ids = {v: k for k, v in full["param_names"].items()}
        got = torch.cat([full["state"][ids[p.name]]["exp_avg"].reshape(-1) for p in manifest.flat_params[i].params])
        assert torch.equal(got, whole[:n]), f"{name}: consolidate unit {i}"
    assert len(full["state"]) == 2 * UNITS, f"{name}: consolidate"


def run(label: str, numel: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    manifest, ranks = build(numel)
    payload = sum(v.numel() * v.element_size() for s in ranks for e in s.values() for v in e.values() if v.dim())
    rows = []
    for fmt, save, floor in (("v1", save_v1, floor_v1), ("v2", save_v2, floor_v2)):
        directory = root / f"{label}-{fmt}"

        def fresh_save(save: Callable[..., None] = save, directory: Path = directory) -> None:
            shutil.rmtree(directory, ignore_errors=True)
            save(directory, manifest, ranks)

        medians: dict[str, float] = {}
        t_save, _ = timed(fresh_save, repeats, medians, "save_s")
        t_floor, _ = timed(lambda floor=floor, directory=directory: floor(directory), repeats, medians, "floor_s")
        t_same, same = timed(lambda directory=directory: load_same(directory), repeats, medians, "same_w_load_s")
        t_other, (other, read) = timed(lambda directory=directory: load_other(directory), repeats, medians, "other_w_load_s")
        t_cons, full = timed(lambda directory=directory: consolidate(directory), repeats, medians, "consolidate_s")
        check(f"{label} {fmt}", manifest, ranks, same, other, full)
        size = sum(f.stat().st_size for f in directory.iterdir())
        rows.append({"model": label, "format": fmt, "params": numel, "payload_bytes": payload, "bytes": size,
                     "floor_s": t_floor, "save_s": t_save, "same_w_load_s": t_same, "other_w_load_s": t_other,
                     "consolidate_s": t_cons, "other_w_read_bytes": read or None, "medians": medians})  # fmt: skip
        del same, other, full
        shutil.rmtree(directory)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<6} {'fmt':<3} {'bytes/payload':>13} {'floor s':>8} | {'save s':>7} {'same-W s':>9} {'other-W s':>10} "
          f"{'consol. s':>9} | {'save/fl':>7} {'same/fl':>7} {'other/fl':>8} {'cons/fl':>7} | {'read/payload':>12}")  # fmt: skip
    for r in rows:
        fl = r["floor_s"]
        ratio = f"{r['other_w_read_bytes'] / r['payload_bytes']:.3f}" if r["other_w_read_bytes"] else "-"
        print(f"{r['model']:<6} {r['format']:<3} {r['bytes'] / r['payload_bytes']:>13.4f} {fl:>8.3f} | {r['save_s']:>7.3f} "
              f"{r['same_w_load_s']:>9.3f} {r['other_w_load_s']:>10.3f} {r['consolidate_s']:>9.3f} | {r['save_s'] / fl:>7.2f} "
              f"{r['same_w_load_s'] / fl:>7.2f} {r['other_w_load_s'] / fl:>8.2f} {r['consolidate_s'] / fl:>7.2f} | {ratio:>12}")  # fmt: skip
    by = {(r["model"], r["format"]): r for r in rows}
    print("\nv2 / v1 (time ratio; < 1: format 2 is faster)")
    for model in dict.fromkeys(r["model"] for r in rows):
        a, b = by[(model, "v1")], by[(model, "v2")]
        parts = [f"{k.removesuffix('_s')} {b[k] / a[k]:.2f}" for k in ("save_s", "same_w_load_s", "other_w_load_s", "consolidate_s")]
        print(f"{model:<6} " + ", ".join(parts) + f", bytes {b['bytes'] / a['bytes']:.4f}")


def header_measurement() -> None:
    """Rank-file size against payload for one tensor per (unit, key) and one tensor per dtype (safetensors' writer)."""
    print(f"{'units':>6} {'payload':>10} | {'per (unit, key): header':>24} {'size/payload':>12} | {'per dtype: header':>17} {'size/payload':>12}")
    for units, numel in ((256, 512), (256, 8), (4096, 3200)):
        g = torch.Generator().manual_seed(0)
        tensors = {f"{i}/{k}": torch.randn(numel, generator=g) for i in range(units) for k in ("exp_avg", "exp_avg_sq")}
        payload = sum(t.numel() * 4 for t in tensors.values())
        with tempfile.TemporaryDirectory() as d:
            sizes = []
            for case in (tensors, {"float32": torch.cat(list(tensors.values()))}):
                path = Path(d) / "f.safetensors"
                safetensors.torch.save_file(case, path, metadata={"format": "fsdp_optim"})
                sizes.append(path.stat().st_size)
        print(f"{units:>6} {payload:>10} | {sizes[0] - payload:>24} {sizes[0] / payload:>12.4f} | {sizes[1] - payload:>17} {sizes[1] / payload:>12.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layout", action="store_true", help="only the rank-file header measurement")
    parser.add_argument("--dir", type=Path, default=STORAGE)
    args = parser.parse_args(argv)
    if args.layout:
        header_measurement()
        return 0
    torch.set_num_threads(1)
    models = QUICK["models"] if args.quick else MODELS
    repeats = QUICK["repeats"] if args.quick else REPEATS
    root = Path(tempfile.mkdtemp(prefix="fsdp-optim-format2-", dir=args.dir))
    try:
        rows = [row for label, numel in models.items() for row in run(label, numel, root, repeats)]  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    SCRATCH.mkdir(exist_ok=True)
    out = SCRATCH / f"format2{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps({"config": {"units": UNITS, "world_size": WORLD_SIZE, "other": OTHER_WORLD_SIZE,
                                          "repeats": repeats, "dir": str(args.dir), "threads": 1}, "rows": rows}, indent=1))  # fmt: skip
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
