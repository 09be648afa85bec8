"""Bad checkpoints on disk are refused with a clear error and change nothing (the file kinds).

One spawn at world size 2 trains the test model (real gloo, real fairscale FSDP, AdamW), saves the
checkpoint every case starts from, a second save of the same model, checkpoints of three other models,
a layout file and a full dict file; rank 0 reshards the checkpoint to 3 ranks offline. The same spawn
then tries every case registered with ``job=`` (the live model it loads into) with
``load_sharded_optim_state`` on every rank and records what each rank raised, whether its optimizer
changed (deep comparison) and, on rank 0, whether any file changed. The other cases need no process group and run in the test process, each through several
entry points: ``consolidate``, ``reshard`` (into a directory that already holds a checkpoint),
``fsdp-optim consolidate`` and ``fsdp-optim inspect``.

A case is a function ``(Source) -> Path`` that builds the bad input from a copy of the job's files and
returns what to hand over, registered with ``@refusal(error, *mentions)``: ``mentions`` are texts the
message must contain, namely the file (or parameter) and what was expected and found; ``{rank0}`` and
``{rank1}`` stand for the names of the checkpoint's rank files. Bad files are made the ways they happen:
cut short, bytes flipped inside a tensor, another file copied over, or written by a writer that follows
the documented format (``fsdp_optim/formats/sharded/manifest.py``) but puts the wrong thing in it, checksums and all.

"Nothing changed" means: every file and directory under the case's input has the same bytes and mtime
(directories' mtimes catch a file created and removed again); for ``reshard``, the checkpoint already
in the target directory still has the same files and consolidates to the same dict; for the CLI, no
output file; in the job, the optimizer's state deep-compares equal to a copy taken before.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _models as M
import pytest
import torch
import torch.distributed as dist
from _checks import assert_identical, snapshot
from _dist import run_ranks
from _forge import V1_MANIFEST, forge_manifest, forge_manifest_json, forge_rank_file, forge_safetensors, to_format1
from torch import nn

from fsdp_optim import consolidate, load_sharded_optim_state, reshard, save_layout, save_sharded_optim_state
from fsdp_optim.cli import main as cli
from fsdp_optim.core.checksums import digest
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME

WORLD_SIZE = 2
STEPS = 2  # before the checkpoint every case starts from: "step" is 2.0 there
CONTROL = "unedited"
CONTROL2 = "unedited format 2"


# --- what the cases start from -----------------------------------------------------------------------


@dataclass
class Source:
    """The job's files (``saved``) and an empty directory (``where``) in which a case builds its input."""

    saved: Path
    where: Path

    def copy(self, name: str = "ckpt") -> Path:
        """A copy of one of the job's checkpoints (mtimes kept), to edit."""
        return Path(shutil.copytree(self.saved / name, self.where / name))

    def file(self, name: str) -> Path:
        return Path(shutil.copy2(self.saved / name, self.where / name))

    def format2(self) -> Path:
        """A copy of the committed format-2 checkpoint (written by an earlier fsdp_optim), to edit."""
        return Path(shutil.copytree(FORMAT2_FIXTURE / "ckpt", self.where / "old2"))


def rank_file(directory: Path, rank: int) -> Path:
    return directory / next(f.file for f in read_manifest(directory).files if f.rank == rank)


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _record_start(raw: bytes, info: zipfile.ZipInfo) -> int:
    """Offset of a stored (uncompressed) zip record's bytes: after its local header, name and extra field."""
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def flip_tensor_byte(path: Path, *, largest: bool = True) -> None:
    """Flip one bit in the middle of the raw bytes of a tensor in a ``torch.save`` file (the largest, or
    the first), leaving the zip structure and the pickle intact: only a content checksum can tell."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        records = [i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0]
    assert records and all(i.compress_type == zipfile.ZIP_STORED for i in records), path
    info = max(records, key=lambda i: i.file_size) if largest else records[0]
    raw[_record_start(raw, info) + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def random_bytes(path: Path, n: int = 4096) -> None:
    path.write_bytes(
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7), dtype=torch.uint8).numpy().tobytes()
    )


# A writer that follows the documented format (fsdp_optim/formats/sharded/manifest.py) and puts the wrong thing in it.


# forge_manifest / forge_rank_file: tests/_forge.py (shared with the adversarial suite).


# --- the catalogue -------------------------------------------------------------------------------------

OFFLINE = ("consolidate", "reshard", "cli consolidate")  # the entry points most cases go through
WITH_INSPECT = (*OFFLINE, "cli inspect")  # manifest-level damage: inspect reads the manifest too
PATHS = ("consolidate", "cli consolidate", "cli inspect")  # a path that is no checkpoint: nothing to reshard
FILES = ("consolidate", "cli consolidate")  # a file of another kind: reshard and inspect take it as what it is


@dataclass(frozen=True)
class Refusal:
    make: Callable[[Source], Path]
    error: type[Exception] | tuple[type[Exception], ...]
    mentions: tuple[str, ...]
    entries: tuple[str, ...] = OFFLINE  # offline entry points; empty for a job case
    job: str | None = None  # the live model a job case loads into (see _live_models)
    refusing: tuple[int, ...] = tuple(range(WORLD_SIZE))  # job case: ranks that must refuse; others load

    @property
    def error_names(self) -> tuple[str, ...]:
        return tuple(e.__name__ for e in (self.error if isinstance(self.error, tuple) else (self.error,)))


CASES: dict[str, Refusal] = {}


def refusal(
    error: type[Exception] | tuple[type[Exception], ...],
    *mentions: str,
    entries: tuple[str, ...] = OFFLINE,
    job: str | None = None,
    refusing: tuple[int, ...] = tuple(range(WORLD_SIZE)),
) -> Callable[[Callable[[Source], Path]], Callable[[Source], Path]]:
    """Register the decorated case under its function name."""

    def register(make: Callable[[Source], Path]) -> Callable[[Source], Path]:
        CASES[make.__name__] = Refusal(make, error, mentions, () if job else entries, job, refusing)
        return make

    return register


# Files that are not what they claim: damaged, foreign, or not checkpoints at all.


@refusal(FileNotFoundError, "{rank1}", "no such file")
def missing_rank_file(src: Source) -> Path:
    d = src.copy()
    rank_file(d, 1).unlink()
    return d


@refusal(ValueError, "{rank1}", "cannot be read with torch.load(weights_only=True)")
def truncated_rank_file(src: Source) -> Path:
    d = src.copy()
    truncate(rank_file(d, 1), 0.5)
    return d


@refusal(ValueError, "{rank1}", "cannot be read with torch.load(weights_only=True)")
def rank_file_missing_its_last_byte(src: Source) -> Path:
    d = src.copy()
    path = rank_file(d, 1)
    path.write_bytes(path.read_bytes()[:-1])
    return d


@refusal(ValueError, "{rank1}", "cannot be read")
def empty_rank_file(src: Source) -> Path:
    d = src.copy()
    rank_file(d, 1).write_bytes(b"")
    return d


@refusal(ValueError, V1_MANIFEST, "cannot be read with torch.load(weights_only=True)", entries=WITH_INSPECT)
def truncated_manifest(src: Source) -> Path:
    d = src.copy()
    truncate(d / V1_MANIFEST, 0.7)
    return d


@refusal(ValueError, "{rank1}", "unit '", "checksum mismatch")
def flipped_byte_in_a_tensor(src: Source) -> Path:
    d = src.copy()
    flip_tensor_byte(rank_file(d, 1))
    return d


@refusal(ValueError, V1_MANIFEST, "checksum mismatch", entries=WITH_INSPECT)
def flipped_byte_in_a_manifest_tensor(src: Source) -> Path:
    d = src.copy()  # the manifest's tensors are the scalar states: "step" of each unit
    flip_tensor_byte(d / V1_MANIFEST, largest=False)
    return d


@refusal(ValueError, V1_MANIFEST, "checksum mismatch", entries=WITH_INSPECT)
def manifest_edited_by_hand(src: Source) -> Path:
    d = src.copy()
    wrapped = torch.load(d / V1_MANIFEST, weights_only=True)
    wrapped["body"]["world_size"] = 3
    torch.save(wrapped, d / V1_MANIFEST)
    return d


@refusal(ValueError, "{rank1}", "checksum mismatch in the file header")
def rank_file_header_edited_by_hand(src: Source) -> Path:
    d = src.copy()
    path = rank_file(d, 1)
    payload = torch.load(path, weights_only=True)
    first = next(iter(payload["unit_checksums"]))
    payload["unit_checksums"][first] = digest("something else")
    torch.save(payload, path)
    return d


@refusal(ValueError, V1_MANIFEST, "cannot be read with torch.load(weights_only=True)", entries=WITH_INSPECT)
def random_bytes_as_manifest(src: Source) -> Path:
    d = src.copy()
    random_bytes(d / V1_MANIFEST)
    return d


@refusal(ValueError, "{rank1}", "cannot be read with torch.load(weights_only=True)")
def random_bytes_as_rank_file(src: Source) -> Path:
    d = src.copy()
    random_bytes(rank_file(d, 1))
    return d


@refusal(
    ValueError, V1_MANIFEST, "expected an fsdp_optim manifest file, found", "'embed.weight'", entries=WITH_INSPECT
)
def model_state_dict_as_manifest(src: Source) -> Path:
    d = src.copy()
    torch.save(M.make_net().state_dict(), d / V1_MANIFEST)
    return d


@refusal(ValueError, "{rank1}", "expected an fsdp_optim rank file, found list")
def tensor_list_as_rank_file(src: Source) -> Path:
    d = src.copy()
    torch.save([torch.zeros(3), torch.ones(2)], rank_file(d, 1))
    return d


# Files of other saves mixed in.


@refusal(ValueError, "{rank1}", "save_id is", "expected", "from the manifest")
def rank_file_of_another_save(src: Source) -> Path:
    d = src.copy()
    other = src.saved / "other"  # the same model and world size, one step later
    shutil.copy2(rank_file(other, 1), rank_file(d, 1))
    return d


@refusal(ValueError, "{rank1}", "rank is 0, expected 1")
def rank_file_of_another_rank(src: Source) -> Path:
    d = src.copy()
    shutil.copy2(rank_file(d, 0), rank_file(d, 1))
    return d


@refusal(ValueError, "{rank1}", "world_size is 3, expected 2")
def rank_file_from_another_world_size(src: Source) -> Path:
    # Rank 1's file of the same state cut for 3 ranks, under this save's id and rank 1's name.
    d = src.copy()
    ws3 = torch.load(rank_file(src.saved / "ws3", 1), weights_only=True)["state"]

    def cut_for_3(state: dict[int, dict[str, Any]]) -> None:
        state.clear()
        state.update(ws3)

    forge_rank_file(d, 1, cut_for_3, world_size=3)
    return d


# Written by a writer that put the wrong thing in (checksums recomputed).


@refusal(ValueError, V1_MANIFEST, "format version 2", "reads 1..1", entries=WITH_INSPECT)
def newer_format_version_in_the_manifest(src: Source) -> Path:
    d = src.copy()
    forge_manifest(d, lambda body: body.update(version=2), version=2)
    return d


@refusal(ValueError, "{rank1}", "version 2", "1..1")
def newer_format_version_in_a_rank_file(src: Source) -> Path:
    d = src.copy()
    forge_rank_file(d, 1, version=2)
    return d


@refusal(ValueError, V1_MANIFEST, "one file per rank 0..1", "found ranks [0]", entries=WITH_INSPECT)
def manifest_lists_no_file_for_a_rank(src: Source) -> Path:
    d = src.copy()
    forge_manifest(d, lambda body: body.update(files=[f for f in body["files"] if f["rank"] == 0]))
    return d


@refusal(ValueError, V1_MANIFEST, "plain name inside the checkpoint directory", "'../optim.pt'", entries=WITH_INSPECT)
def manifest_names_a_file_outside_its_directory(src: Source) -> Path:
    d = src.copy()
    forge_manifest(d, lambda body: body["files"][1].update(file="../optim.pt"))
    return d


@refusal(
    ValueError,
    "{rank1}",
    "unit 'block1'",
    "state keys ['exp_avg', 'step']",
    "expected ['step', 'exp_avg', 'exp_avg_sq']",
)
def state_key_missing_in_one_rank_file(src: Source) -> Path:
    d = src.copy()
    forge_rank_file(d, 1, lambda state: state[1].pop("exp_avg_sq"))
    return d


@refusal(ValueError, "{rank1}", "unit 'block1'", "state 'exp_avg'", "torch.float64", "expected (49,) torch.float32")
def wrong_dtype_in_a_rank_file(src: Source) -> Path:
    d = src.copy()
    forge_rank_file(d, 1, lambda state: state[1].update(exp_avg=state[1]["exp_avg"].double()))
    return d


@refusal(ValueError, "{rank1}", "unit 'block1'", "state 'exp_avg' is (48,)", "expected (49,)")
def wrong_shard_length_in_a_rank_file(src: Source) -> Path:
    d = src.copy()
    forge_rank_file(d, 1, lambda state: state[1].update(exp_avg=state[1]["exp_avg"][:-1].clone()))
    return d


@refusal(ValueError, "{rank1}", "'step'", "3.0", "2.0")
def scalar_state_of_a_rank_file_differs_from_the_manifest(src: Source) -> Path:
    d = src.copy()
    forge_rank_file(d, 1, lambda state: state[1].update(step=state[1]["step"] + 1))
    return d


# Format 2 (manifest.json, safetensors rank files; the job's "ckpt2"): damaged, mixed, or written by a writer
# that follows the format and puts the wrong thing in it (checksums recomputed, the manifest's records updated).

V2 = "ckpt2"  # written by this version (format 3; the cases' names say "format2" since safetensors came in 2)
FORMAT2_FIXTURE = Path(__file__).parent / "fixtures" / "v2_adam_w2"


@refusal(FileNotFoundError, "{v2rank1}", "no such file")
def format2_missing_rank_file(src: Source) -> Path:
    d = src.copy(V2)
    rank_file(d, 1).unlink()
    return d


@refusal(ValueError, "{v2rank1}", "tensor 'float32'", "data_offsets", "lie outside the file's")
def format2_truncated_rank_file(src: Source) -> Path:
    d = src.copy(V2)
    truncate(rank_file(d, 1), 0.5)
    return d


@refusal(ValueError, "{v2rank1}", "0 bytes, too short for a safetensors file")
def format2_empty_rank_file(src: Source) -> Path:
    d = src.copy(V2)
    rank_file(d, 1).write_bytes(b"")
    return d


@refusal(ValueError, "{v2rank1}", "unit '", "checksum mismatch in elements")
def format2_flipped_byte_in_a_shard(src: Source) -> Path:
    d = src.copy(V2)
    path = rank_file(d, 1)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    data = bytearray(path.read_bytes())
    data[8 + n + (len(data) - 8 - n) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return d


@refusal(ValueError, MANIFEST_NAME, "not a JSON manifest", entries=WITH_INSPECT)
def format2_truncated_manifest(src: Source) -> Path:
    d = src.copy(V2)
    truncate(d / MANIFEST_NAME, 0.7)
    return d


@refusal(ValueError, MANIFEST_NAME, "not a JSON manifest", entries=WITH_INSPECT)
def format2_random_bytes_as_manifest(src: Source) -> Path:
    d = src.copy(V2)
    random_bytes(d / MANIFEST_NAME)
    return d


@refusal(ValueError, MANIFEST_NAME, "checksum mismatch in the manifest", entries=WITH_INSPECT)
def format2_manifest_edited_by_hand(src: Source) -> Path:
    d = src.copy(V2)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["body"]["param_groups"][0]["hyperparams"]["lr"] = 0.5
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    return d


@refusal(ValueError, MANIFEST_NAME, "expected an fsdp_optim manifest", "found list", entries=WITH_INSPECT)
def format2_manifest_that_is_a_json_list(src: Source) -> Path:
    d = src.copy(V2)
    (d / MANIFEST_NAME).write_text("[1, 2, 3]")
    return d


@refusal(ValueError, MANIFEST_NAME, "format version 4", "reads manifest.json of versions 2, 3", entries=WITH_INSPECT)
def format2_newer_format_version(src: Source) -> Path:
    d = src.copy(V2)
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["fsdp_optim_checkpoint"]["version"] = 4
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    return d


@refusal(ValueError, MANIFEST_NAME, "'world_size' must be int", "found str '2'", entries=WITH_INSPECT)
def format2_manifest_world_size_as_a_string(src: Source) -> Path:
    d = src.copy(V2)
    forge_manifest_json(d, lambda body: body.update(world_size="2"), raw=True)
    return d


@refusal(ValueError, MANIFEST_NAME, "'flat_params' must be list or tuple", "found dict", entries=WITH_INSPECT)
def format2_manifest_units_as_an_object(src: Source) -> Path:
    d = src.copy(V2)
    forge_manifest_json(d, lambda body: body.update(flat_params={"0": body["flat_params"][0]}), raw=True)
    return d


@refusal(ValueError, MANIFEST_NAME, "expected one of the tags", "'$pickle'", entries=WITH_INSPECT)
def format2_manifest_value_with_an_unknown_tag(src: Source) -> Path:
    d = src.copy(V2)
    forge_manifest_json(d, lambda body: body["param_groups"][0]["hyperparams"].update(lr={"$pickle": "cos\nsystem"}), raw=True)
    return d


@refusal(ValueError, MANIFEST_NAME, "declares 4294967296 bytes", "holds up to 4096", entries=WITH_INSPECT)
def format2_manifest_scalar_tensor_declaring_four_gigabytes(src: Source) -> Path:
    d = src.copy(V2)

    def huge_step(body: dict[str, Any]) -> None:
        entry = next(e for e in body["flat_params"][1]["state"] if e["key"] == "step")
        entry["value"] = {"$tensor": {"dtype": "float32", "shape": [1 << 30], "hex": ""}}

    forge_manifest_json(d, huge_step, raw=True)
    return d


@refusal(ValueError, MANIFEST_NAME, "missing 'segments'", entries=WITH_INSPECT)
def format2_manifest_without_segments(src: Source) -> Path:
    d = src.format2()
    forge_manifest_json(d, lambda body: body["files"][1].pop("segments"), raw=True)
    return d


@refusal(ValueError, "{v2rank1}", "declares a 1099511627776-byte header", "expected at most")
def format2_header_length_beyond_the_file(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, header_length=1 << 40)
    return d


@refusal(ValueError, "{v2rank1}", "the safetensors header is not JSON")
def format2_header_that_is_not_json(src: Source) -> Path:
    d = src.copy(V2)
    path = rank_file(d, 1)
    raw = bytearray(path.read_bytes())
    raw[8:16] = b"\xff\xfe{{{{{{"
    path.write_bytes(bytes(raw))
    return d


@refusal(ValueError, "{v2rank1}", "tensor 'float32'", "data_offsets [0, 4611686018427387904] lie outside")
def format2_tensor_declaring_four_exbibytes(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["float32"].update(shape=[1 << 60], data_offsets=[0, 1 << 62]))
    return d


@refusal(ValueError, "{v2rank1}", "tensor 'float32'", "span", "expected", "for shape")
def format2_shape_disagreeing_with_its_offsets(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["float32"].update(shape=[h["float32"]["shape"][0] + 1]))
    return d


@refusal(ValueError, "{v2rank1}", "at data_offsets", "overlaps the tensor before it")
def format2_overlapping_tensors(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h.update(float64={"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}))
    return d


@refusal(ValueError, "{v2rank1}", "tensor 'float32'", "dtype 'F16', expected 'F32'")
def format2_wrong_dtype_in_the_header(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["float32"].update(dtype="F16"))
    return d


@refusal(ValueError, "{v2rank1}", "shape [2, 49]", "expected [n]")
def format2_two_dimensional_tensor(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["float32"].update(shape=[2, 49]))
    return d


@refusal(ValueError, "{v2rank1}", "world_size is '3'", "expected '2' from the manifest")
def format2_rank_file_of_another_world_size(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["__metadata__"].update(world_size="3"))
    return d


@refusal(ValueError, "{v2rank1}", "save_id is", "expected", "from the manifest")
def format2_rank_file_of_another_save(src: Source) -> Path:
    d = src.copy(V2)
    shutil.copy2(rank_file(src.saved / "other2", 1), rank_file(d, 1))
    return d


@refusal(ValueError, "{v2rank1}", "rank is '0', expected '1'")
def format2_rank_file_of_another_rank(src: Source) -> Path:
    d = src.copy(V2)
    shutil.copy2(rank_file(d, 0), rank_file(d, 1))
    return d


@refusal(ValueError, "{v2rank1}", "the tensors cover", "but the file holds")
def format2_data_appended_after_the_last_tensor(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, data=lambda b: b + bytes(4))
    return d


def _segments(body: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    return next(f for f in body["files"] if f["rank"] == rank)["segments"]


@refusal(ValueError, "{oldrank1}", "segment of flat parameter", "overlaps the one before")
def format2_manifest_segments_overlapping(src: Source) -> Path:
    d = src.format2()
    forge_manifest_json(d, lambda body: _segments(body, 1)[1].update(offset=_segments(body, 1)[0]["offset"]), raw=True)
    return d


@refusal(ValueError, "{oldrank1}", "unit 'block1' state 'exp_avg' is 50 elements", "expected 49 elements")
def format2_manifest_segment_longer_than_its_shard(src: Source) -> Path:
    d = src.format2()

    def longer(body: dict[str, Any]) -> None:
        seg = next(s for s in _segments(body, 1) if s["flat"] == 1 and s["key"] == "exp_avg")
        seg["numel"] += 1

    forge_manifest_json(d, longer, raw=True)
    return d


@refusal(ValueError, "{oldrank1}", "flat parameter 1, state 'exp_avg_sq' is missing")
def format2_manifest_missing_a_segment(src: Source) -> Path:
    d = src.format2()

    def drop(body: dict[str, Any]) -> None:
        body["files"][1]["segments"] = [s for s in _segments(body, 1) if (s["flat"], s["key"]) != (1, "exp_avg_sq")]

    forge_manifest_json(d, drop, raw=True)
    return d


@refusal(ValueError, "{oldrank1}", "0 chunk checksums, expected 1")
def format2_manifest_without_chunk_checksums(src: Source) -> Path:
    d = src.format2()
    forge_manifest_json(d, lambda body: _segments(body, 1)[0].update(checksums=[]), raw=True)
    return d




# Format 3 keeps its chunk checksums in each rank file's header; a forger who rewrites them also rewrites the
# manifest's record of the file (forge_safetensors does), so only the structure of what is there can refuse.


def _checksums(edit: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any]], None]:
    def apply(header: dict[str, Any]) -> None:
        found = json.loads(header["__metadata__"]["checksums"])
        edit(found)
        header["__metadata__"]["checksums"] = json.dumps(found)

    return apply


@refusal(ValueError, "{v2rank1}", "tensor 'float32' has 0 chunk checksums, expected 1")
def format3_header_without_chunk_checksums(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, _checksums(lambda c: c.update(float32=[])))
    return d


@refusal(ValueError, "{v2rank1}", "chunk checksums for tensors []", "expected ['float32']")
def format3_header_checksums_of_no_tensor(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, _checksums(lambda c: c.clear()))
    return d


@refusal(ValueError, "{v2rank1}", "the header's 'checksums' is not JSON")
def format3_header_checksums_that_are_not_json(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["__metadata__"].update(checksums="[[[{"))
    return d


@refusal(ValueError, "{v2rank1}", "chunk_bytes is '1'", "expected '65536' from the manifest")
def format3_rank_file_of_another_chunk_size(src: Source) -> Path:
    d = src.copy(V2)
    forge_safetensors(d, 1, lambda h: h["__metadata__"].update(chunk_bytes="1"))
    return d


@refusal(ValueError, "{v2rank1}", "holds tensors {{'float32': 301}}", "the manifest's units make {{'float32': 302}}")
def format3_rank_file_one_element_short(src: Source) -> Path:
    d = src.copy(V2)

    def shorter(h: dict[str, Any]) -> None:
        n = h["float32"]["shape"][0]
        h["float32"].update(shape=[n - 1], data_offsets=[0, 4 * (n - 1)])

    forge_safetensors(d, 1, shorter, data=lambda b: b[:-4])
    return d


# Paths that are not sharded checkpoints.


@refusal(ValueError, "not a sharded checkpoint", "manifest.json or manifest.pt", entries=PATHS)
def empty_directory(src: Source) -> Path:
    d = src.where / "empty"
    d.mkdir()
    return d


@refusal(FileNotFoundError, "nothing-here", "no such checkpoint directory or file", entries=PATHS)
def path_that_does_not_exist(src: Source) -> Path:
    return src.where / "nothing-here"


@refusal(ValueError, "not a sharded checkpoint", "a save that never finished", entries=PATHS)
def save_that_never_finished(src: Source) -> Path:
    d = src.copy()  # every rank file written, no manifest
    (d / V1_MANIFEST).unlink()
    return d


@refusal(ValueError, "layout.pt", "lists no rank files", "a layout file", entries=FILES)
def layout_file_given_as_checkpoint(src: Source) -> Path:
    return src.file("layout.pt")


@refusal(ValueError, "full.pt", "expected an fsdp_optim manifest file, found", "'param_groups'", entries=FILES)
def full_dict_file_given_as_checkpoint(src: Source) -> Path:
    return src.file("full.pt")


@refusal(ValueError, "{rank0}", "expected an fsdp_optim manifest file, found", entries=FILES)
def rank_file_given_as_checkpoint(src: Source) -> Path:
    return rank_file(src.copy(), 0)


# Loaded into a job (world size 2): the checkpoint does not fit the model or optimizer, or a file is bad.


@refusal(ValueError, "optim", "saved from SGD, found AdamW", job="deep")
def manifest_from_another_optimizer_class(src: Source) -> Path:
    d = src.copy()
    forge_manifest(d, lambda body: body.update(optimizer="SGD"))
    return d


@refusal(ValueError, V1_MANIFEST, "format version 2", job="deep")
def newer_format_version_loaded_in_a_job(src: Source) -> Path:
    return newer_format_version_in_the_manifest(src)


@refusal(ValueError, V1_MANIFEST, "cannot be read", job="deep")
def truncated_manifest_loaded_in_a_job(src: Source) -> Path:
    return truncated_manifest(src)


@refusal(FileNotFoundError, "{rank1}", "no such file", job="deep")  # every rank refuses: a load is all or nothing
def own_rank_file_missing_in_a_job(src: Source) -> Path:
    # Same world size and layout: each rank reads only its own file, so only rank 1 can notice.
    return missing_rank_file(src)


@refusal(ValueError, "{rank1}", "checksum mismatch", job="deep")  # every rank refuses: a load is all or nothing
def flipped_byte_in_own_rank_file_in_a_job(src: Source) -> Path:
    return flipped_byte_in_a_tensor(src)


@refusal(ValueError, "{rank1}", "save_id is", job="deep")  # every rank refuses: a load is all or nothing
def rank_file_of_another_save_in_a_job(src: Source) -> Path:
    return rank_file_of_another_save(src)


@refusal(FileNotFoundError, "rank00001-of-00003", "no such file", job="deep")
def rank_file_missing_when_resharding_on_load(src: Source) -> Path:
    # Saved at 3 ranks, loaded at 2: both ranks need part of rank 1's file.
    d = src.copy("ws3")
    rank_file(d, 1).unlink()
    return d


@refusal(ValueError, "'unused.weight'", "shape (3, 3) in the model", "(3, 4)", job="deep")
def checkpoint_of_a_model_with_another_shape(src: Source) -> Path:
    return src.copy("wider")


@refusal(ValueError, "'unused.weight'", "missing from", job="deep")
def checkpoint_missing_a_parameter(src: Source) -> Path:
    return src.copy("smaller")


@refusal(ValueError, "'extra.bias'", "(and 1 more)", "which the model does not have", job="deep")
def checkpoint_with_an_extra_parameter(src: Source) -> Path:
    return src.copy("extra")


@refusal(ValueError, "'exp_avg'", "float32", "expected float16", job="half")
def checkpoint_of_another_dtype(src: Source) -> Path:
    return src.copy()


@refusal(ValueError, "splits", "'block2.proj.weight' in group 1", "'block2.inner.a.weight' in group 0", job="shallow")
def checkpoint_whose_param_groups_split_a_unit(src: Source) -> Path:
    # The checkpoint puts block2.inner in group 0 and block2 in group 1; the shallow model makes them one unit.
    d = src.copy()

    def move_inner(body: dict[str, Any]) -> None:
        inner = next(i for i, f in enumerate(body["flat_params"]) if f["unit"] == "block2.inner")
        for group in body["param_groups"]:
            group["flat_indices"] = [i for i in group["flat_indices"] if i != inner]
        body["param_groups"][0]["flat_indices"].append(inner)

    forge_manifest(d, move_inner)
    return d


@refusal(ValueError, "1 param groups", "has 2", job="one group")
def checkpoint_with_more_param_groups_than_the_optimizer(src: Source) -> Path:
    return src.copy()


@refusal(ValueError, "{rank1}", "'step'", "3.0", "2.0", job="deep")  # every rank refuses: a load is all or nothing
def scalar_state_of_own_rank_file_differs_from_the_manifest_in_a_job(src: Source) -> Path:
    # Each rank reads only its own file here: rank 1 alone can tell, and must, or it resumes at step 3.
    return scalar_state_of_a_rank_file_differs_from_the_manifest(src)


@refusal(ValueError, "optim.bin", "cannot be read", job="deep")
def random_bytes_as_a_full_dict_file(src: Source) -> Path:
    # Not a directory: loaded as a full dict by rank 0 and scattered; rank 1 hears rank 0's error.
    path = src.where / "optim.bin"
    random_bytes(path)
    return path


@refusal(ValueError, "not a sharded checkpoint", job="deep")
def empty_directory_loaded_in_a_job(src: Source) -> Path:
    return empty_directory(src)


@refusal(ValueError, "{v2rank1}", "checksum mismatch", job="deep")  # every rank refuses: a load is all or nothing
def format2_flipped_byte_in_own_rank_file_in_a_job(src: Source) -> Path:
    return format2_flipped_byte_in_a_shard(src)


@refusal(ValueError, "{v2rank1}", "save_id is", job="deep")  # every rank refuses: a load is all or nothing
def format2_rank_file_of_another_save_in_a_job(src: Source) -> Path:
    return format2_rank_file_of_another_save(src)


@refusal(ValueError, MANIFEST_NAME, "checksum mismatch in the manifest", job="deep")
def format2_manifest_edited_by_hand_in_a_job(src: Source) -> Path:
    return format2_manifest_edited_by_hand(src)


# --- the job: makes every file the cases start from, then tries the job cases -------------------------


def _variant(kind: str) -> nn.Module:
    net = M.make_net()
    if kind == "wider":
        net.unused = nn.Linear(4, 3)  # weight (3, 4) where the test model has (3, 3)
    elif kind == "smaller":
        del net.unused
    elif kind == "extra":
        net.extra = nn.Linear(2, 2)
    elif kind == "half":
        net = net.half()
    return net


def _live_models(rank: int) -> dict[str, tuple[Any, torch.optim.Optimizer]]:
    """The models and optimizers job cases load into, each one step into training (so a load would change it)."""
    live = {}
    for name, nesting, net, groups in [
        ("deep", "deep", M.make_net(), None),
        ("shallow", "shallow", M.make_net(), None),
        ("half", "deep", _variant("half"), None),  # fairscale's pure fp16 mode (it refuses float64)
        ("one group", "deep", M.make_net(), "one"),
    ]:
        fp16 = {"compute_dtype": torch.float16} if name == "half" else {}
        model = M.wrap(net, nesting, **fp16)
        optim = torch.optim.AdamW(list(model.parameters()) if groups else M.fsdp_param_groups(model), lr=0.01)
        tokens, targets = M.local_batch(10, rank, WORLD_SIZE)
        M.train_step(model, optim, tokens, targets)
        live[name] = (model, optim)
    return live


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: relative path -> (mtime in ns, size and sha256 for files)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_file():
            out[str(path.relative_to(root))] = (
                st.st_mtime_ns,
                st.st_size,
                hashlib.sha256(path.read_bytes()).hexdigest(),
            )
        else:
            out[str(path.relative_to(root)) + "/"] = (st.st_mtime_ns,)
    return out


def _tree_difference(before: dict[str, tuple], after: dict[str, tuple]) -> str | None:
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return None if not changed else f"changed: {changed}"


def _try_in_job(rank: int, kind: str, case: Refusal, live: dict, out: Path) -> dict[str, Any]:
    where = out / "job" / kind
    if rank == 0:
        where.mkdir(parents=True)
        path = case.make(Source(out, where))
        (out / "job" / f"{kind}.path").write_text(str(path))
    dist.barrier()
    path = Path((out / "job" / f"{kind}.path").read_text())
    before_files = _tree(where) if rank == 0 else None
    model, optim = live[case.job]
    before = snapshot(optim.state_dict())
    outcome: dict[str, Any] = {"error": None, "message": ""}
    try:
        load_sharded_optim_state(model, optim, path)
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        outcome = {"error": type(e).__name__, "message": str(e), "where": traceback.format_exc(limit=-2)}
    try:
        assert_identical(snapshot(optim.state_dict()), before, "optimizer state")
        outcome["optim_changed"] = None
    except AssertionError as e:
        outcome["optim_changed"] = str(e)
    optim.load_state_dict(before)  # the next case starts from the trained state again
    dist.barrier()
    outcome["files_changed"] = _tree_difference(before_files, _tree(where)) if rank == 0 else None
    return outcome


def _job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    out = Path(out_dir)
    model = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(model))
    for step in range(STEPS):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    save_sharded_optim_state(model, optim, out / "ckpt")
    full = model.gather_full_optim_state_dict(optim)
    M.train_step(model, optim, *M.local_batch(STEPS, rank, world_size))
    save_sharded_optim_state(model, optim, out / "other")
    for kind in ("wider", "smaller", "extra"):
        variant = M.wrap(_variant(kind), "deep")
        variant_optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(variant))
        M.train_step(variant, variant_optim, *M.local_batch(0, rank, world_size))
        save_sharded_optim_state(variant, variant_optim, out / kind)
    if rank == 0:
        torch.save(full, out / "full.pt")
        save_layout(model, out / "layout.pt")
        reshard(out / "ckpt", 3, out / "ws3")
        # Format 2 as saved ("ckpt2", "other2"); every other checkpoint rewritten as format 1 for the cases
        # that forge format-1 files.
        for name in ("ckpt", "other"):
            shutil.copytree(out / name, out / f"{name}2")
        for name in ("ckpt", "other", "wider", "smaller", "extra", "ws3"):
            to_format1(out / name)
    live = _live_models(rank)
    dist.barrier()
    outcomes = {kind: _try_in_job(rank, kind, case, live, out) for kind, case in CASES.items() if case.job}
    for name, control_of in ((CONTROL, "ckpt"), (CONTROL2, "ckpt2")):
        control = Refusal(lambda src, n=control_of: src.copy(n), Exception, (), job="deep", refusing=())  # type: ignore[misc]
        outcomes[name] = _try_in_job(rank, name, control, live, out)
    return {"full": full, "outcomes": outcomes}


@dataclass
class Saved:
    out: Path
    full: dict[str, Any]  # what the checkpoint holds, as gathered by the job
    outcomes: list[dict[str, dict[str, Any]]]  # per rank: job case -> outcome
    names: dict[str, str]  # placeholders of the mentions

    def mentions(self, case: Refusal) -> list[str]:
        return [m.format(**self.names) for m in case.mentions]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    out = tmp_path_factory.mktemp("disk-refusals")
    results = run_ranks(_job, WORLD_SIZE, str(out))
    names = {f"rank{r}": rank_file(out / "ckpt", r).name for r in range(WORLD_SIZE)}
    names |= {f"v2rank{r}": rank_file(out / "ckpt2", r).name for r in range(WORLD_SIZE)}
    names |= {f"oldrank{r}": rank_file(FORMAT2_FIXTURE / "ckpt", r).name for r in range(WORLD_SIZE)}
    return Saved(out, results[0]["full"], [r["outcomes"] for r in results], names)


# --- the tests -------------------------------------------------------------------------------------------

# Bugs found by this catalogue, strict xfail until fixed: kind -> description (every entry point of the kind).
KNOWN_BUGS: dict[str, str] = {}


def _marks(kind: str) -> list[Any]:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[kind])] if kind in KNOWN_BUGS else []


def _offline_params() -> list[Any]:
    return [
        pytest.param(kind, entry, marks=_marks(kind), id=f"{kind}-{entry.replace(' ', '_')}")
        for kind, case in CASES.items()
        for entry in case.entries
    ]


def _attempt(entry: str, path: Path, outputs: Path, capsys: pytest.CaptureFixture) -> tuple[str | None, str]:
    """Hand ``path`` to an entry point: what it raised (type name, message), or the CLI's exit code and stderr."""
    if entry.startswith("cli "):
        argv = [entry.removeprefix("cli "), str(path)]
        argv += ["-o", str(outputs / "full.pt")] if entry == "cli consolidate" else []
        argv += ["--world-size", "3", "-o", str(outputs / "target")] if entry == "cli reshard" else []
        code = cli(argv)
        captured = capsys.readouterr()
        return f"exit {code}", captured.err + captured.out
    call = {"consolidate": lambda: consolidate(path), "reshard": lambda: reshard(path, 3, outputs / "target")}[entry]
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("kind, entry", _offline_params())
def test_offline_refusal_is_clear_and_changes_nothing(
    kind: str, entry: str, saved: Saved, tmp_path: Path, capsys
) -> None:
    case = CASES[kind]
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    outputs.mkdir()
    if entry == "reshard":  # the target already holds a checkpoint, which must survive
        shutil.copytree(saved.out / "ws3", outputs / "target")
    path = case.make(Source(saved.out, inputs))
    before, outputs_before = _tree(inputs), _tree(outputs)

    raised, message = _attempt(entry, path, outputs, capsys)

    if entry.startswith("cli "):
        assert raised == "exit 1", f"{entry}: expected exit code 1, got {raised}: {message!r}"
        assert message.startswith("fsdp-optim: error: ") and message.count("\n") == 1, message
        mentions = [path.name]  # one line naming what it could not use
    else:
        assert raised in case.error_names, f"{entry}: expected {' or '.join(case.error_names)}, got {raised}: {message}"
        mentions = saved.mentions(case)
    missing = [text for text in mentions if text not in message]
    assert not missing, f"{entry}: the message lacks {missing}: {message!r}"
    assert _tree_difference(before, _tree(inputs)) is None, f"{entry}: the input changed"
    if entry == "reshard":
        target = outputs / "target"
        kept = {V1_MANIFEST} | {f.file for f in read_manifest(target).files}
        assert {k: v for k, v in _tree(outputs).items() if Path(k).name in kept} == {
            k: v for k, v in outputs_before.items() if Path(k).name in kept
        }, "reshard touched the checkpoint already in its target directory"
        expected = {**saved.full, "fsdp_optim": {**saved.full["fsdp_optim"], "world_size": 3}}
        assert_identical(consolidate(target), expected, "the target's checkpoint")
    else:
        assert _tree_difference(outputs_before, _tree(outputs)) is None, f"{entry}: wrote something"


@pytest.mark.parametrize("name", ["ckpt", "ckpt2"])
@pytest.mark.parametrize("entry", sorted({e for c in CASES.values() for e in c.entries}))
def test_offline_control_succeeds(entry: str, name: str, saved: Saved, tmp_path: Path, capsys) -> None:
    """The unedited checkpoint (format 1, and 2) goes through every entry point, so each case fails for its own reason."""
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    outputs.mkdir()
    path = Source(saved.out, inputs).copy(name)
    raised, message = _attempt(entry, path, outputs, capsys)
    assert raised in (None, "exit 0"), f"{entry}: {raised}: {message}"
    if entry == "consolidate":
        assert_identical(consolidate(path), saved.full, "consolidated")


def _job_kinds() -> list[Any]:
    return [pytest.param(kind, marks=_marks(kind)) for kind, case in CASES.items() if case.job]


@pytest.mark.parametrize("kind", _job_kinds())
def test_job_refusal_is_clear_and_changes_nothing(kind: str, saved: Saved) -> None:
    case = CASES[kind]
    for rank, per_rank in enumerate(saved.outcomes):
        got = per_rank[kind]
        if rank not in case.refusing:  # the control: every rank loads
            assert got["error"] is None, f"rank {rank}: expected a load, got {got}"
            continue
        assert got["error"] in case.error_names, f"rank {rank}: expected {' or '.join(case.error_names)}, got {got}"
        missing = [text for text in saved.mentions(case) if text not in got["message"]]
        assert not missing, f"rank {rank}: the message lacks {missing}: {got['message']!r}"
        assert got["optim_changed"] is None, f"rank {rank}: the optimizer changed: {got['optim_changed']}"
    assert saved.outcomes[0][kind]["files_changed"] is None, saved.outcomes[0][kind]["files_changed"]


@pytest.mark.parametrize("control", [CONTROL, CONTROL2])
def test_job_control_succeeds(control: str, saved: Saved) -> None:
    for rank, per_rank in enumerate(saved.outcomes):
        got = per_rank[control]
        assert got["error"] is None, f"rank {rank}: {got}"
        assert got["optim_changed"] is not None, (
            f"rank {rank}: loading the checkpoint should change the trained optimizer"
        )
    assert saved.outcomes[0][control]["files_changed"] is None


def test_catalogue_covers_enough_kinds() -> None:
    assert len(CASES) >= 15, sorted(CASES)


# --- reshard's output directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["new directory", "directory holding a checkpoint"])
def test_refused_reshard_leaves_its_target_as_it_was(target: str, saved: Saved, tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    outputs.mkdir()
    if target != "new directory":
        shutil.copytree(saved.out / "ws3", outputs / "target")
    source = flipped_byte_in_a_tensor(Source(saved.out, inputs))
    before = _tree(outputs)
    with pytest.raises(ValueError, match="checksum mismatch"):
        reshard(source, 3, outputs / "target")
    assert _tree_difference(before, _tree(outputs)) is None


@pytest.mark.parametrize("kind", ["path_that_does_not_exist", "empty_directory"])
def test_reshard_says_what_is_wrong_with_the_source_path(kind: str, saved: Saved, tmp_path: Path, capsys) -> None:
    path = CASES[kind].make(Source(saved.out, tmp_path))
    _, message = _attempt("reshard", path, tmp_path, capsys)
    _, err = _attempt("cli reshard", path, tmp_path, capsys)
    for said in (message, err):
        assert "layout" not in said and ("no such" in said or "not a sharded checkpoint" in said), said
