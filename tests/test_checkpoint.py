"""Sharded checkpoints end to end, with real files and real gloo process groups.

One job at world size 2 trains, saves twice into the same directory (the second save replaces the
first), writes a full dict too, then "crashes" in the middle of a third save (rank files written, no
manifest). Offline, with no process group: the directory consolidates to exactly what
``gather_full_optim_state_dict`` returned, and reshards to 3 ranks from the directory or from the full
file. A job at world size 3 then resumes three ways (resharded directory: each rank reads its own file;
the world-size-2 directory under another FSDP nesting: re-cut on the fly; the full file: scattered from
one rank) and training goes on to match uninterrupted unwrapped training.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import struct
from pathlib import Path

import _models as M
import pytest
import torch
import torch.distributed as dist
from _checks import assert_full_matches_plain, assert_identical, assert_unchanged, snapshot
from _dist import run_ranks

from fsdp_optim import consolidate, load_sharded_optim_state, reshard, save_sharded_optim_state
from fsdp_optim.core.checksums import digest
from fsdp_optim.core.plan import plan
from fsdp_optim.formats.sharded.file_record import HEADER_KEY
from fsdp_optim.formats.sharded.legacy import unwrap
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest, manifest_source
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.formats.sharded.writer import write_shard_file


def plan_recut(manifest: Manifest, target):  # the engine's plan for a checkpoint's records (nothing is read)
    return plan(manifest_source(manifest, "checkpoint", read=None), target)  # type: ignore[arg-type]

OPTIMIZERS = ["adamw", "nadam"]  # tensors + step; NAdam adds a second 0-dim state (mu_product)
FIRST_SAVE, SAVE_AT, TOTAL = 2, 3, 5
REL = 1e-4


def _skip_unused(name: str) -> bool:
    # A flat parameter gives a never-used parameter a zero gradient, hence state (see README "Known limits").
    return name.startswith("unused.")


def _train_and_save(rank: int, world_size: int, out: str) -> dict:
    results = {}
    for name in OPTIMIZERS:
        directory = os.path.join(out, name)
        root = M.wrap(M.make_net(), "deep")
        optim = M.OPTIMIZERS[name](M.fsdp_param_groups(root))
        save_sharded_optim_state(root, optim, os.path.join(out, f"{name}-before-training"))  # no state yet
        empty = root.gather_full_optim_state_dict(optim)
        for step in range(SAVE_AT):
            if step == FIRST_SAVE:
                save_sharded_optim_state(root, optim, directory)  # replaced by the next save
                first = sorted(os.listdir(directory))
            M.train_step(root, optim, *M.local_batch(step, rank, world_size))
        before = snapshot(optim.state_dict())
        manifest_path = save_sharded_optim_state(root, optim, directory)
        assert_unchanged(before, optim)
        second = sorted(os.listdir(directory))
        full = root.gather_full_optim_state_dict(optim)
        model_state = root.state_dict()
        if rank == 0:
            torch.save(full, os.path.join(out, f"{name}.full.pt"))
            torch.save(model_state, os.path.join(out, f"{name}.model.pt"))
        # A crash in the middle of a third save: every rank file is written, the manifest never is.
        write_shard_file(Path(directory), {}, save_id="deadbeef" * 4, rank=rank, world_size=world_size)
        if rank == 0:
            (Path(directory) / f".{MANIFEST_NAME}.tmp.{os.getpid()}.0123abcd").write_bytes(b"torn")
            results[name] = {"full": full, "first": first, "second": second, "manifest": str(manifest_path), "empty": empty}
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sharded")
    return out, run_ranks(_train_and_save, 2, str(out))[0]


def test_saves_replace_each_other_and_consolidate_offline_bit_identical(saved) -> None:
    out, results = saved
    assert not dist.is_initialized()  # offline: this process has no process group
    for name in OPTIMIZERS:
        r = results[name]
        first_files = {f for f in r["first"] if f.startswith("optim-")}
        assert len(first_files) == 2 and MANIFEST_NAME in r["first"]
        second_files = {f for f in r["second"] if f.startswith("optim-")}
        assert len(second_files) == 2 and not first_files & second_files, "files of the first save must be gone"
        # The torn third save left its files, yet the manifest still names the second save's.
        listing = set(os.listdir(out / name))
        assert len({f for f in listing if f.startswith("optim-deadbeef")}) == 2
        assert {f.file for f in read_manifest(out / name).files} == second_files
        assert_identical(consolidate(out / name), r["full"], name)
        assert_identical(consolidate(r["manifest"]), r["full"], name)  # the manifest path works too
        assert_identical(consolidate(out / f"{name}-before-training"), r["empty"], f"{name} before training")
        # Mappings dropped after every unit (the memory bound at its tightest): same bits.
        assert_identical(consolidate(out / name, max_mapped_bytes=1), r["full"], name)


def test_manifest_describes_the_layout(saved) -> None:
    out, _ = saved
    manifest = read_manifest(out / "adamw")
    assert manifest.world_size == 2 and manifest.optimizer == "AdamW"
    assert [f.unit for f in manifest.flat_params] == ["", "block1", "block2", "block2.inner", "frozen"]
    assert [len(g.flat_indices) for g in manifest.groups] == [3, 2]
    for flat in manifest.flat_params:  # torch.chunk semantics: only the last rank pads, by ceil(n/2)*2 - n
        assert flat.padding() == [0, -(-flat.numel // 2) * 2 - flat.numel]
    assert Manifest.from_dict(manifest.to_dict(), source="roundtrip") == manifest
    assert manifest.flat_params[4].state == ()  # the frozen unit never had a gradient
    assert plan_recut(manifest, manifest.layout(0)).identity
    assert not plan_recut(manifest, manifest.with_world_size(3).layout(0)).identity


def test_reshard_offline_from_directory_and_from_full_file(saved, tmp_path) -> None:
    out, results = saved
    for name in OPTIMIZERS:
        full = results[name]["full"]
        for world_size in (1, 3, 4):
            from_dir = reshard(out / name, world_size, tmp_path / f"{name}-{world_size}-dir")
            from_full = reshard(out / f"{name}.full.pt", world_size, tmp_path / f"{name}-{world_size}-full", layout=out / name)
            a, b = read_manifest(from_dir), read_manifest(from_full)
            assert a.world_size == b.world_size == world_size and len(a.files) == world_size
            expected = {**full, "fsdp_optim": {**full["fsdp_optim"], "world_size": world_size}}
            assert_identical(consolidate(from_dir), expected, f"{name} via directory at {world_size}")
            assert_identical(consolidate(from_full), expected, f"{name} via full file at {world_size}")
            # Both routes write the same shards.
            with open_checkpoint(from_dir, lazy=False) as x, open_checkpoint(from_full, lazy=False) as y:
                for rank in range(world_size):
                    assert_identical(x.load_rank(rank), y.load_rank(rank), f"{name} rank {rank}")
    # Resharding a resharded checkpoint again lands on the same full dict.
    again = reshard(tmp_path / "adamw-3-dir", 2, tmp_path / "adamw-back")
    assert_identical(consolidate(again), results["adamw"]["full"], "3 -> 2")


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_files_are_refused_with_the_file_named(saved, tmp_path) -> None:
    out, _ = saved
    src = out / "adamw"
    rank1 = next(f.file for f in read_manifest(src).files if f.rank == 1)

    # A byte changed inside a rank file's data (header and checksums kept): a chunk's checksum fails.
    bad = _corrupt_copy(src, tmp_path / "flipped")
    data = bytearray((bad / rank1).read_bytes())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    data[(header_end + len(data)) // 2] ^= 0x10
    (bad / rank1).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{rank1}, unit '.*checksum mismatch in elements"):
        consolidate(bad)

    # A truncated file (a torn copy): refused by its header's offsets, named.
    torn = _corrupt_copy(src, tmp_path / "torn")
    data = (torn / rank1).read_bytes()
    (torn / rank1).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{rank1}: truncated: .*tensor 'float32': data_offsets .* lie outside the file's"):
        consolidate(torn)

    # A rank file of another save under the right name.
    mixed = _corrupt_copy(src, tmp_path / "mixed")
    stray = next(f for f in os.listdir(mixed) if f.startswith("optim-deadbeef") and "rank00001" in f)
    shutil.copy(mixed / stray, mixed / rank1)
    with pytest.raises(ValueError, match=rf"{rank1}: save_id is '{'deadbeef' * 4}', expected"):
        consolidate(mixed)

    # An edited manifest.
    edited = _corrupt_copy(src, tmp_path / "edited")
    wrapped = json.loads((edited / MANIFEST_NAME).read_text())
    wrapped["body"]["world_size"] = 3
    (edited / MANIFEST_NAME).write_text(json.dumps(wrapped))
    with pytest.raises(ValueError, match=rf"{MANIFEST_NAME}: checksum mismatch"):
        consolidate(edited)

    # No manifest: a save that never finished, or not a checkpoint.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        consolidate(empty)
    with pytest.raises(FileNotFoundError):
        consolidate(tmp_path / "missing")
    with pytest.raises(ValueError, match="is the source checkpoint's directory"):
        reshard(src, 3, src)
    with pytest.raises(ValueError, match="needs the model's layout"):
        reshard(out / "adamw.full.pt", 3, tmp_path / "nolayout")
    with pytest.raises(ValueError, match="world_size: expected an int >= 1, found 0"):
        reshard(src, 0, tmp_path / "zero")
    with pytest.raises(ValueError, match="expected a full optimizer state dict"):
        reshard(out / "adamw.model.pt", 2, tmp_path / "model", layout=src)


def test_manifest_records_refuse_inconsistent_input(saved) -> None:
    out, _ = saved
    body = read_manifest(out / "adamw").to_dict()
    body["flat_params"][1]["params"][0]["shape"] = [1, 2]
    with pytest.raises(ValueError, match="offset .* expected"):
        Manifest.from_dict(body, source="m.pt")
    body = read_manifest(out / "adamw").to_dict()
    body["flat_params"][1]["padding"] = [0, 5]
    with pytest.raises(ValueError, match=r"m.pt, flat_params\[1\] \(unit 'block1'\): 'padding' is \[0, 5\], expected"):
        Manifest.from_dict(body, source="m.pt")
    body = read_manifest(out / "adamw").to_dict()
    body["version"] = 99
    with pytest.raises(ValueError, match="format version 99"):
        Manifest.from_dict(body, source="m.pt")
    body = read_manifest(out / "adamw").to_dict()
    del body["param_groups"]
    with pytest.raises(ValueError, match="m.pt: missing 'param_groups'"):
        Manifest.from_dict(body, source="m.pt")
    with pytest.raises(ValueError, match="expected an fsdp_optim manifest file"):
        unwrap({"state": {}}, "manifest", source="x.pt")
    assert digest({"a": torch.arange(3.0)}) == digest({"a": torch.arange(3.0)}) != digest({"a": torch.arange(4.0)})
    assert HEADER_KEY in json.loads((out / "adamw" / MANIFEST_NAME).read_text())


def _resume(rank: int, world_size: int, out: str, fresh: str) -> dict:
    results = {}
    for name in OPTIMIZERS:
        full = torch.load(os.path.join(out, f"{name}.full.pt"), weights_only=True)
        # Each rank gets a private copy of the resharded checkpoint holding the manifest and its own
        # file only: loading from it proves that a rank reads nothing else.
        own = os.path.join(fresh, f"{name}-rank{rank}-only")
        os.makedirs(own)
        manifest = read_manifest(os.path.join(fresh, name))
        for file in (MANIFEST_NAME, next(f.file for f in manifest.files if f.rank == rank)):
            shutil.copy(os.path.join(fresh, name, file), own)
        sources = {
            "resharded": (own, "deep", True),
            "recut": (os.path.join(out, name), "shallow", False),  # 2 -> 3 ranks, other nesting, unflattened
            "scatter": (os.path.join(out, f"{name}.full.pt"), "deep", True),  # src rank reads, others receive
        }
        for how, (path, nesting, flatten) in sources.items():
            if name != "adamw" and how != "recut":  # the other routes carry scalars the same way; save time
                continue
            root = M.wrap(M.make_net(seed=123), nesting, flatten=flatten)
            root.load_state_dict(torch.load(os.path.join(out, f"{name}.model.pt"), weights_only=True))
            optim = M.OPTIMIZERS[name](M.fsdp_param_groups(root))
            load_sharded_optim_state(root, optim, path if how != "scatter" or rank == 1 else "-", src_rank=1)
            # Every route lands on exactly the shard the in-memory path cuts from the full dict.
            assert_identical(optim.state_dict(), root.get_shard_from_optim_state_dict(full, optim=optim), how)
            for step in range(SAVE_AT, TOTAL):
                M.train_step(root, optim, *M.local_batch(step, rank, world_size))
            # fairscale's state_dict() cannot run unflattened with a never-used parameter (README "Known
            # limits"); there the final optimizer state, which depends on every step's weights, suffices.
            model_state = root.state_dict() if flatten else None
            final = root.gather_full_optim_state_dict(optim)
            if rank == 0:
                results[(name, how)] = (model_state, final)

    # Refusals happen on every rank, before the optimizer is touched, and nothing hangs.
    root = M.wrap(M.make_net(), "deep")
    optim = torch.optim.SGD(M.fsdp_param_groups(root), lr=0.1, momentum=0.9)
    M.train_step(root, optim, *M.local_batch(0, rank, world_size))
    before = snapshot(optim.state_dict())
    for path in (os.path.join(fresh, "adamw"), os.path.join(out, "adamw.full.pt")):
        try:
            load_sharded_optim_state(root, optim, path)
        except ValueError as exc:
            assert "saved from AdamW, found SGD" in str(exc), exc
        else:
            raise AssertionError(f"loading {path} into SGD must fail")
        assert_unchanged(before, optim)
    return results


def test_resume_at_another_world_size_three_ways(saved, tmp_path) -> None:
    out, _ = saved
    for name in OPTIMIZERS:
        reshard(out / name, 3, tmp_path / name)
    results = run_ranks(_resume, 3, str(out), str(tmp_path))[0]
    for name in OPTIMIZERS:
        net, plain = M.train_plain(name, range(TOTAL))
        for how in ("resharded", "recut", "scatter") if name == "adamw" else ("recut",):
            model_state, final = results[(name, how)]
            for key, value in net.state_dict().items() if model_state is not None else ():
                if not _skip_unused(key):
                    atol = REL * float(value.abs().max())
                    torch.testing.assert_close(
                        model_state[key], value, rtol=REL, atol=atol, msg=lambda m: f"{name} {how} {key}: {m}"
                    )
            assert_full_matches_plain(final, plain.state_dict(), skip=_skip_unused, rel=REL)


PURE = ["formats/sharded/manifest.py", "formats/sharded/reader.py", "formats/sharded/writer.py", "core/plan.py", "offline/operations.py", "offline/cuts.py", "formats/fairscale.py", "cli/__init__.py", "cli/parser.py", "cli/inspect.py", "cli/verbs.py", "formats/sharded/rank_file.py", "formats/sharded/manifest_json.py"]


@pytest.mark.parametrize("module", PURE)
def test_offline_modules_never_import_torch_distributed(module: str) -> None:
    tree = ast.parse((Path(__file__).resolve().parent.parent / "fsdp_optim" / module).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not {n for n in imported if n.startswith("torch.distributed") or n.endswith("transport")}, sorted(imported)
