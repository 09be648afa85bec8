"""The adversarial suite : hostile files, paths, dicts and outputs, each refused clearly,
with nothing changed on disk, in bounded time and memory.

One spawn at world size 2 trains the test model (real gloo, real fairscale FSDP, AdamW) and writes what
the attacks start from: a sharded checkpoint, its full dict, a layout file. Every attack builds its
input in a directory of its own from copies of those (or forges one by hand, ``tests/_attacks.py``),
hashes that directory, hands the input to each entry point in a child process forked from a preloaded
forkserver with an address-space limit (``RLIMIT_AS``: the child's size plus 768 MiB) and a timeout,
and then asserts:

- the child raised the documented exception type (the CLI: exit code 1, exactly one line on stderr,
  no traceback, no raw control character), naming what was wrong and where;
- it neither timed out nor died (so the bound held: a bomb that allocated or looped would have);
- the directory hashes the same (names, kinds, bytes, symlink targets): nothing written, nothing lost.

Attack classes (see ``ATTACKS``; the test ``test_catalogue_is_large_enough`` counts them): ``bomb``
(declared sizes, zero strides, inflating or overlapping records, exponential or cyclic or deep
structures, huge integers and world sizes, aliasing), ``kind`` (quantized, sparse, meta, complex,
nested tensors, legacy and protocol-4 files), ``path`` (FIFOs, devices, directories and symlinks where
a file is expected), ``malformed`` (mistyped and misshapen full dicts and manifests), ``names``
(terminal control sequences), ``writer`` (outputs that are inputs, foreign directories, files and
symlinks in the way). A hypothesis property mutates the real checkpoint's files (bytes and structure)
and requires that only documented exceptions come out, within the same bounds.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _attacks as A
import _models as M
import pytest
import torch
from _dist import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_optim import save_layout, save_sharded_optim_state
from fsdp_optim.formats.sharded.file_record import HEADER_KEY
from fsdp_optim.formats.sharded.manifest import LEGACY_MANIFEST_NAME, MANIFEST_NAME

WORLD_SIZE = 2
CLI_ERROR = "fsdp-optim: error: "


# --- what the attacks start from ----------------------------------------------------------------------


def _job(rank: int, world_size: int, out_dir: str) -> None:
    out = Path(out_dir)
    model = M.wrap(M.make_net(), "deep")
    optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(model))
    for step in range(2):
        M.train_step(model, optim, *M.local_batch(step, rank, world_size))
    save_sharded_optim_state(model, optim, out / "ckpt")
    full = model.gather_full_optim_state_dict(optim)
    if rank == 0:
        torch.save(full, out / "full.pt")
        save_layout(model, out / "layout.pt")
        # "ckpt2" as saved (format 2); "ckpt" rewritten as format 1, which the attacks before format 2 forge.
        shutil.copytree(out / "ckpt", out / "ckpt2")
        A.to_format1(out / "ckpt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adversarial")
    run_ranks(_job, WORLD_SIZE, str(out))
    return out


@dataclass
class Case:
    saved: Path  # the job's files: never handed to an entry point
    where: Path  # this attack's directory: its inputs and its outputs, hashed before and after

    def copy(self, name: str = "ckpt") -> Path:
        return Path(shutil.copytree(self.saved / name, self.where / name, symlinks=True))

    def file(self, name: str) -> Path:
        return Path(shutil.copy2(self.saved / name, self.where / name))

    def full(self) -> dict[str, Any]:
        return torch.load(self.saved / "full.pt", weights_only=True)

    def save_full(self, full: Any, name: str = "full.pt", **kwargs: Any) -> Path:
        torch.save(full, self.where / name, **kwargs)
        return self.where / name

    @property
    def layout(self) -> str:
        return str(self.saved / "layout.pt")

    @property
    def out(self) -> Path:
        return self.where / "out"


# --- the catalogue ---------------------------------------------------------------------------------------

# Entry points an input can be handed to. A checkpoint directory: consolidate, reshard, the CLI's
# consolidate and inspect. A full dict file: loaded, resharded with the layout, converted and inspected
# by the CLI. An in-memory dict (built in the child by a builder of _attacks): reshard and to_named.
DIRECTORY = ("consolidate", "reshard", "cli consolidate", "cli inspect")
FULL_FILE = ("load", "reshard full", "cli convert", "cli inspect")
IN_MEMORY = ("reshard dict", "to_named")
RANK_FILES = ("consolidate", "reshard", "cli consolidate")  # inspect reads the manifest only


@dataclass(frozen=True)
class Attack:
    cls: str
    make: Callable[[Case], Any]
    error: tuple[str, ...]  # acceptable exception types (a base class counts)
    mentions: tuple[str, ...]  # texts the message must contain
    entries: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)


ATTACKS: dict[str, Attack] = {}


def attack(cls: str, error: str | tuple[str, ...], *mentions: str, entries: tuple[str, ...], **extra: Any) -> Callable:
    def register(make: Callable[[Case], Any]) -> Callable[[Case], Any]:
        ATTACKS[make.__name__] = Attack(cls, make, (error,) if isinstance(error, str) else error, mentions, entries, extra)
        return make

    return register


def _pid(full: dict[str, Any], name: str) -> int:
    return next(i for i, n in full["param_names"].items() if n == name)


# Resource bombs: a file declares more than it holds, or a structure expands beyond its size.


@attack("bomb", "ValueError", "strides (0, 0)", "dense, non-overlapping", entries=FULL_FILE)
def zero_stride_tensor_declaring_a_terabyte(case: Case) -> Path:
    full = case.full()
    full["state"][_pid(full, "block1.0.weight")]["exp_avg"] = torch.zeros(1).expand(1 << 19, 1 << 19)
    return case.save_full(full)


@attack("bomb", "ValueError", "strides (0,)", "dense, non-overlapping", entries=RANK_FILES)
def zero_stride_tensor_in_a_rank_file(case: Case) -> Path:
    d = case.copy()
    path = A.rank_file(d, 1)
    payload = torch.load(path, weights_only=True)
    payload["state"][1]["exp_avg"] = torch.zeros(1).expand(1 << 40)  # checksums would have to read 4 TiB
    torch.save(payload, path)
    size = path.stat().st_size  # the manifest records the new size (not its checksums: they would read 4 TiB)
    A.forge_manifest(d, lambda body: next(f for f in body["files"] if f["rank"] == 1).update(bytes=size))
    return d


@attack("bomb", "ValueError", "declares 40000000000 bytes", "its record holds 16", entries=FULL_FILE)
def storage_declaring_more_than_its_record(case: Case) -> Path:
    s = A.Storage("0", bytes(16), declared=10**10)
    return A.write_torch_zip(case.where / "full.pt", {"state": {0: {"exp_avg": A.Tensor(s, (4,), (1,))}}}, [s])


@attack("bomb", "ValueError", "compressed", "could inflate", entries=FULL_FILE)
def compressed_record_inflating_to_a_gibibyte(case: Case) -> Path:
    path = case.where / "full.pt"
    shutil.copy(case.saved.parent / "bomb.pt", path)
    return path


@attack("bomb", "ValueError", "past the end", entries=FULL_FILE)
def record_declaring_bytes_past_the_end_of_the_file(case: Case) -> Path:
    path = case.save_full(case.full())
    record = next(n for n in zipfile.ZipFile(path).namelist() if "/data/" in n)
    A.patch_zip_entry(path, record, size=(1 << 31) - 1)
    return path


@attack("bomb", "ValueError", "overlap", entries=FULL_FILE)
def two_records_over_the_same_bytes(case: Case) -> Path:
    path = case.save_full(case.full())
    records = [n for n in zipfile.ZipFile(path).namelist() if "/data/" in n]
    A.patch_zip_entry(path, records[1], header_offset_of=records[0])
    return path


@attack("bomb", "ValueError", "bytearray", entries=FULL_FILE)
def bytearray_of_ten_gigabytes_in_the_pickle(case: Case) -> Path:
    return A.write_torch_zip(case.where / "full.pt", {"state": A.Call(bytearray, 10**10)})


@attack("bomb", "ValueError", "more than", "MAX_NODES", entries=FULL_FILE)
def shared_references_doubling_sixty_times(case: Case) -> Path:
    return A.write_torch_zip(case.where / "full.pt", None, pickle_data=A.doubling_pickle(30))


@attack("bomb", "ValueError", "nested deeper than 32", entries=FULL_FILE)
def lists_nested_a_hundred_thousand_deep(case: Case) -> Path:
    return A.write_torch_zip(case.where / "full.pt", None, pickle_data=A.nested_list_pickle(100_000))


@attack("bomb", "ValueError", "contains itself", entries=FULL_FILE)
def a_list_that_contains_itself(case: Case) -> Path:
    return A.write_torch_zip(case.where / "full.pt", None, pickle_data=A.cyclic_pickle())


@attack("bomb", "ValueError", "world size 1000000000", "above the bound", entries=DIRECTORY)
def manifest_declaring_a_billion_ranks(case: Case) -> Path:
    d = case.copy()
    A.forge_manifest(d, lambda body: body.update(world_size=10**9))
    return d


@attack("bomb", "ValueError", "declares", "bytes of state", entries=RANK_FILES)  # inspect allocates nothing
def manifest_declaring_a_terabyte_parameter(case: Case) -> Path:
    d = case.copy()

    def grow(body: dict[str, Any]) -> None:
        flat = next(f for f in body["flat_params"] if f["unit"] == "block1")
        flat["params"] = [{"name": p["name"], "shape": [1 << 20, 1 << 20] if i == 0 else p["shape"]}
                          for i, p in enumerate(flat["params"])]
        numel = sum(int(torch.Size(p["shape"]).numel()) for p in flat["params"])
        flat.update(numel=numel, padding=[0, -(-numel // 2) * 2 - numel])

    A.forge_manifest(d, grow)
    return d


@attack("bomb", "ValueError", "world_size", "above the bound", entries=("reshard to a million ranks",))
def reshard_to_a_million_ranks(case: Case) -> Path:
    return case.copy()


@attack("bomb", "ValueError", "an integer of", "bits", entries=FULL_FILE)
def hyperparameter_of_a_hundred_thousand_digits(case: Case) -> Path:
    full = case.full()
    full["param_groups"][0]["lr"] = 10**100_000
    return case.save_full(full)


@attack("bomb", "ValueError", "referenced 2 times", entries=FULL_FILE)
def one_tensor_as_the_state_of_two_parameters(case: Case) -> Path:
    full = case.full()
    shared = torch.zeros(7, 6)
    full["state"][_pid(full, "block1.0.weight")]["exp_avg"] = shared
    full["state"][_pid(full, "block1.0.weight")]["exp_avg_sq"] = shared
    return case.save_full(full)


@attack("bomb", "ValueError", "shares memory", entries=("load", "reshard full", "cli convert"))
def overlapping_views_of_one_buffer(case: Case) -> Path:
    full = case.full()
    buffer = torch.zeros(80)
    full["state"][_pid(full, "block1.0.weight")]["exp_avg"] = buffer[:42].view(7, 6)
    full["state"][_pid(full, "block1.0.weight")]["exp_avg_sq"] = buffer[30:72].view(7, 6)
    return case.save_full(full)


# Tensors of a kind optimizer state never is; file formats we do not read.


def _replace_exp_avg(case: Case, make: Callable[[torch.Tensor], Any], **save: Any) -> Path:
    full = case.full()
    entries = full["state"][_pid(full, "norm.weight")]
    entries["exp_avg"] = make(entries["exp_avg"])
    return case.save_full(full, **save)


@attack("kind", "ValueError", "a quantized tensor", entries=FULL_FILE)
def quantized_tensor(case: Case) -> Path:
    return _replace_exp_avg(case, lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8))


@attack("kind", "ValueError", "a sparse tensor", entries=FULL_FILE)
def sparse_tensor(case: Case) -> Path:
    return _replace_exp_avg(case, lambda t: t.to_sparse())


@attack("kind", "ValueError", "a meta tensor", entries=FULL_FILE)
def meta_tensor_of_a_terabyte(case: Case) -> Path:
    return _replace_exp_avg(case, lambda t: torch.empty(1 << 40, device="meta"))


@attack("kind", "ValueError", "a complex tensor", entries=FULL_FILE)
def complex_tensor(case: Case) -> Path:
    return _replace_exp_avg(case, lambda t: t.to(torch.complex64))


@attack("kind", "ValueError", "a nested tensor", entries=FULL_FILE)
def nested_tensor(case: Case) -> Path:
    return _replace_exp_avg(case, lambda t: torch.nested.nested_tensor([t, t[:2]]))


@attack("kind", "ValueError", "not a zip file", "torch 1.6", entries=FULL_FILE)
def legacy_torch_save_format(case: Case) -> Path:
    return case.save_full(case.full(), _use_new_zipfile_serialization=False)


@attack("kind", "ValueError", "STACK_GLOBAL", entries=FULL_FILE)
def pickle_protocol_4(case: Case) -> Path:
    return case.save_full(case.full(), pickle_protocol=4)


# What is at the path is not a regular file (or is one outside the checkpoint).


@attack("path", "ValueError", "a FIFO", "expected a regular file", entries=FULL_FILE)
def fifo_as_a_full_dict(case: Case) -> Path:
    os.mkfifo(case.where / "full.pt")  # nobody writes to it: reading it would wait forever
    return case.where / "full.pt"


@attack("path", "ValueError", "a FIFO", "expected a regular file", entries=RANK_FILES)
def fifo_as_a_rank_file(case: Case) -> Path:
    d = case.copy()
    path = A.rank_file(d, 1)
    path.unlink()
    os.mkfifo(path)
    return d


@attack("path", "ValueError", "a FIFO", "expected a regular file", entries=DIRECTORY)
def fifo_as_the_manifest(case: Case) -> Path:
    d = case.copy()
    (d / LEGACY_MANIFEST_NAME).unlink()
    os.mkfifo(d / LEGACY_MANIFEST_NAME)
    return d


@attack("path", "ValueError", "a directory", "expected a regular file", entries=RANK_FILES)
def directory_in_place_of_a_rank_file(case: Case) -> Path:
    d = case.copy()
    path = A.rank_file(d, 1)
    path.unlink()
    path.mkdir()
    return d


@attack("path", "ValueError", "a symbolic link", "expected a regular file", entries=RANK_FILES)
def rank_file_symlinked_out_of_the_directory(case: Case) -> Path:
    d = case.copy()
    path = A.rank_file(d, 1)
    outside = case.where / "elsewhere.pt"
    path.rename(outside)
    path.symlink_to(outside)
    return d


def _manifest_symlinked_to_another_checkpoints(case: Case, name: str) -> Path:
    d, other = case.copy(name), Path(shutil.copytree(case.saved / name, case.where / "other"))
    manifest = A.manifest_of(d)
    (d / manifest).unlink()
    (d / manifest).symlink_to(other / manifest)  # the same save's: followed, it would read as valid
    return d


SYMLINKED = (*DIRECTORY, "cli verify", "cli reshard")


@attack("path", "ValueError", "manifest.pt: is a symbolic link", "expected a regular file", entries=SYMLINKED)
def manifest_symlinked_to_another_checkpoints_manifest(case: Case) -> Path:
    return _manifest_symlinked_to_another_checkpoints(case, "ckpt")


@attack("path", "ValueError", "manifest.json: is a symbolic link", "expected a regular file", entries=SYMLINKED)
def format3_manifest_symlinked_to_another_checkpoints_manifest(case: Case) -> Path:
    return _manifest_symlinked_to_another_checkpoints(case, "ckpt2")


@attack("path", "ValueError", "a character device", entries=("load", "cli convert", "cli inspect"))
def dev_zero_as_a_full_dict(case: Case) -> str:
    return "/dev/zero"  # endless bytes: reading it would never finish


# Mistyped and misshapen dicts (in memory: the builder runs in the child) and manifests.


@attack("malformed", "ValueError", "nested deeper than 32", entries=IN_MEMORY, builder="deep")
def full_dict_nested_forty_deep(case: Case) -> Any:
    return None


@attack("malformed", "ValueError", "['params']", "parameter id", "list", entries=IN_MEMORY, builder="list_id")
def param_group_listing_a_list_as_an_id(case: Case) -> Any:
    return None


@attack("malformed", "ValueError", "key 3", "expected a string", entries=IN_MEMORY, builder="int_key")
def state_keyed_by_an_int(case: Case) -> Any:
    return None


@attack("malformed", "ValueError", "parameter id 1.5", entries=IN_MEMORY, builder="float_id")
def state_for_a_float_id(case: Case) -> Any:
    return None


@attack("malformed", "ValueError", "['param_groups'][0]", "a str, expected a dict", entries=IN_MEMORY, builder="str_group")
def param_group_that_is_a_string(case: Case) -> Any:
    return None


@attack("malformed", "ValueError", "'step'", "'norm.weight'", "shape (3,)", "0-dim", entries=IN_MEMORY, builder="vector_step")
def one_dim_step_where_a_scalar_is_expected(case: Case) -> Any:
    return None


@attack("malformed", "ValueError", "scalar state 'step'", "shape (2,)", entries=DIRECTORY)
def one_dim_scalar_in_the_manifest(case: Case) -> Path:
    d = case.copy()

    def vector(body: dict[str, Any]) -> None:
        for flat in body["flat_params"]:
            for e in flat["state"]:
                if e["key"] == "step":
                    e["value"] = torch.tensor([2.0, 2.0])

    A.forge_manifest(d, vector)
    return d


@attack("malformed", "ValueError", "real dtype", "'qint8'", entries=DIRECTORY)
def quantized_dtype_in_the_manifest(case: Case) -> Path:
    d = case.copy()
    A.forge_manifest(d, lambda body: body["flat_params"][1].update(dtype="qint8"))
    return d


@attack("malformed", "ValueError", "'padding' lists 1 ranks", "expected 2", entries=DIRECTORY)
def padding_shorter_than_the_world(case: Case) -> Path:
    d = case.copy()
    A.forge_manifest(d, lambda body: body["flat_params"][1].update(padding=[0]))
    return d


@attack("malformed", "ValueError", "name", "expected a string", entries=("reshard full", "cli convert"))
def parameter_named_by_a_tensor(case: Case) -> Path:
    full = case.full()
    full["param_names"][0] = torch.zeros(2)
    return case.save_full(full)


# Names with terminal control sequences are printed escaped.


@attack("names", "ValueError", "twice", entries=("reshard full", "cli convert"))
def parameter_name_with_terminal_control_sequences(case: Case) -> Path:
    full = case.full()
    hostile = "norm.weight\x1b[2J\x1b[31m\r\x07"  # clear the screen, red, carriage return, bell
    full["param_names"][_pid(full, "norm.weight")] = hostile
    full["param_names"][_pid(full, "norm.bias")] = hostile  # twice: an error that quotes the name
    return case.save_full(full)


# Outputs that would destroy something (offline; the concurrent writers are in test_writers.py).


@attack("writer", "ValueError", "is the source checkpoint's directory", entries=("reshard into a symlink to the source",))
def reshard_output_is_the_source_through_a_symlink(case: Case) -> Path:
    d = case.copy()
    (case.where / "alias").symlink_to(d)
    return d


@attack("writer", "ValueError", "one of the inputs", entries=("cli consolidate into its own manifest",))
def consolidate_output_is_its_own_manifest(case: Case) -> Path:
    return case.copy()


@attack("writer", "ValueError", "one of the inputs", entries=("cli convert into a hard link of its source",))
def convert_output_is_a_hard_link_of_its_source(case: Case) -> Path:
    source = case.file("full.pt")
    os.link(source, case.where / "link.pt")
    return source


@attack("writer", "ForeignOutputError", "that are not an fsdp_optim", "notes.txt", entries=("reshard into",))
def reshard_into_a_directory_of_someone_elses_files(case: Case) -> Path:
    case.out.mkdir()
    (case.out / "notes.txt").write_text("a colleague's notes")
    (case.out / "optim-deadbeef0000-rank00000-of-00001.pt").write_text("named like ours, not ours")
    return case.copy()


@attack("writer", "ForeignOutputError", "manifest.pt is not an fsdp_optim manifest", entries=("reshard into",))
def reshard_into_a_directory_with_a_foreign_manifest(case: Case) -> Path:
    case.out.mkdir()
    torch.save(M.make_net().state_dict(), case.out / LEGACY_MANIFEST_NAME)
    return case.copy()


@attack("writer", "ForeignOutputError", "is not a directory", entries=("reshard into",))
def reshard_into_a_regular_file(case: Case) -> Path:
    case.out.write_text("a file where the output directory goes")
    return case.copy()


# Format 2 (manifest.json, safetensors rank files; "ckpt2"): the same classes of attack on the files it reads.


@attack("bomb", "ValueError", "declares a 1152921504606846976-byte header", "expected at most", entries=RANK_FILES)
def format2_header_length_of_an_exbibyte(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_safetensors(d, 1, header_length=1 << 60)
    return d


@attack("bomb", "ValueError", "data_offsets [0, 4611686018427387904] lie outside", entries=RANK_FILES)
def format2_tensor_declaring_four_exbibytes(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_safetensors(d, 1, lambda h: h["float32"].update(shape=[1 << 60], data_offsets=[0, 1 << 62]))
    return d


@attack("bomb", "ValueError", "overlaps the tensor before it", entries=RANK_FILES)
def format2_two_tensors_over_the_same_bytes(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_safetensors(d, 1, lambda h: h.update(float64=dict(h["float32"], dtype="F64", shape=[h["float32"]["shape"][0] // 2])))
    return d


@attack("bomb", "ValueError", "unit 'block1'", "alone is declared 549755813", entries=RANK_FILES)
def format2_manifest_declaring_a_terabyte_parameter(case: Case) -> Path:
    d = case.copy("ckpt2")

    def grow(body: dict[str, Any]) -> None:
        flat = next(f for f in body["flat_params"] if f["unit"] == "block1")
        flat["params"] = [{"name": p["name"], "shape": [1 << 20, 1 << 20] if i == 0 else p["shape"]}
                          for i, p in enumerate(flat["params"])]
        numel = sum(int(torch.Size(p["shape"]).numel()) for p in flat["params"])
        flat.update(numel=numel, padding=[0, -(-numel // 2) * 2 - numel])

    A.forge_manifest_json(d, grow, raw=True)
    return d


@attack("bomb", "ValueError", "world size 1000000000", "above the bound", entries=DIRECTORY)
def format2_manifest_declaring_a_billion_ranks(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_manifest_json(d, lambda body: body.update(world_size=10**9), raw=True)
    return d


@attack("bomb", "ValueError", "nested deeper than 64 levels", entries=DIRECTORY)
def format2_manifest_nested_a_million_deep(case: Case) -> Path:
    d = case.copy("ckpt2")
    (d / MANIFEST_NAME).write_text("[" * 1_000_000 + "]" * 1_000_000)
    return d


@attack("bomb", "ValueError", "not a JSON manifest", "digits", entries=DIRECTORY)
def format2_manifest_integer_of_a_hundred_thousand_digits(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_manifest_text(d, lambda text: text.replace('"world_size":2', '"world_size":' + "9" * 100_000, 1))
    return d


@attack("bomb", "ValueError", "declares 4294967296 bytes", entries=DIRECTORY)
def format2_manifest_scalar_declaring_four_gigabytes(case: Case) -> Path:
    d = case.copy("ckpt2")

    def huge(body: dict[str, Any]) -> None:
        entry = next(e for e in body["flat_params"][1]["state"] if e["key"] == "step")
        entry["value"] = {"$tensor": {"dtype": "float32", "shape": [1 << 15, 1 << 15], "hex": ""}}

    A.forge_manifest_json(d, huge, raw=True)
    return d


def _nested(depth: int) -> Any:
    value: Any = 0.5
    for _ in range(depth):
        value = [value]
    return value


DEEP = (*DIRECTORY, "cli reshard", "reshard with it as the layout", "cli reshard with it as the layout")


@attack("bomb", "ValueError", "nested deeper than 64", "['param_groups'][0]['hyperparams']['lr']", entries=DEEP)
def format3_manifest_hyperparameter_nested_six_hundred_deep(case: Case) -> Path:
    d = case.copy("ckpt2")  # json.loads reads 600 levels; what consumes the value recursively would not
    A.forge_manifest_json(d, lambda body: body["param_groups"][0]["hyperparams"].update(lr=_nested(600)), raw=True)
    return d


@attack("bomb", "ValueError", "nested deeper than 64", "['body']['flat_params'][0]['state']", entries=DIRECTORY)
def format2_manifest_scalar_state_nested_six_hundred_deep(case: Case) -> Path:
    d = case.copy("ckpt2")
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc[HEADER_KEY]["version"] = doc["body"]["version"] = 2  # format 2: the general reader (checksum canonical)
    next(e for e in doc["body"]["flat_params"][0]["state"] if e["key"] == "step")["value"] = _nested(600)
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    A.forge_manifest_json(d, lambda body: None, raw=True)
    return d


@attack("malformed", "ValueError", "the key 'checksum' appears twice", entries=DIRECTORY)
def format3_manifest_with_a_second_checksum_after_a_wrong_one(case: Case) -> Path:
    d = case.copy("ckpt2")
    text = (d / MANIFEST_NAME).read_text()
    wrong = '"checksum":"xxh3-128:' + "0" * 32 + '",'
    (d / MANIFEST_NAME).write_text(text.replace('"checksum":', wrong + '"checksum":', 1))  # json keeps the last
    return d


@attack("malformed", "ValueError", "the key 'world_size' appears twice", entries=DIRECTORY)
def format3_manifest_with_a_second_world_size(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_manifest_text(d, lambda text: text.replace('"world_size":2', '"world_size":3,"world_size":2', 1))
    return d


@attack("malformed", "ValueError", "the key 'format' appears twice", entries=RANK_FILES)
def format3_rank_file_header_with_a_key_twice(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_safetensors(d, 1, text=lambda t: t.replace(b'"format":', b'"format":"not ours","format":', 1))
    return d


@attack("malformed", "ValueError", "dtype 'BF16', expected 'F32'", entries=RANK_FILES)
def format2_wrong_dtype_in_a_rank_file(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_safetensors(d, 1, lambda h: h["float32"].update(dtype="BF16"))
    return d


@attack("malformed", "ValueError", "'world_size' must be int", "found str", entries=DIRECTORY)
def format2_manifest_world_size_as_a_string(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_manifest_json(d, lambda body: body.update(world_size="2"), raw=True)
    return d


@attack("malformed", "ValueError", "'params' must be list or tuple", "found int", entries=DIRECTORY)
def format2_manifest_params_as_a_number(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_manifest_json(d, lambda body: body["flat_params"][1].update(params=7), raw=True)
    return d


@attack("malformed", "ValueError", "expected one of the tags", entries=DIRECTORY)
def format2_manifest_hyperparameter_with_an_unknown_tag(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_manifest_json(d, lambda body: body["param_groups"][0]["hyperparams"].update(lr={"$reduce": "os.system"}), raw=True)
    return d


@attack("malformed", "ValueError", "chunk checksums of 'float32' must be a list of strings", entries=DIRECTORY)
def format3_header_checksums_as_numbers(case: Case) -> Path:
    d = case.copy("ckpt2")
    A.forge_safetensors(d, 0, lambda h: h["__metadata__"].update(checksums=json.dumps({"float32": [1, 2]})))
    return d


@attack("bomb", "ValueError", "-byte header, expected at most", "1/256 of the file", entries=DIRECTORY)
def format3_header_with_a_million_chunk_checksums(case: Case) -> Path:
    d = case.copy("ckpt2")
    many = json.dumps({"float32": ["xxh3-128:" + "0" * 32] * 1_000_000})  # 45 MB of header for a 1 KiB file
    A.forge_safetensors(d, 0, lambda h: h["__metadata__"].update(checksums=many))
    return d


@attack("path", "ValueError", "a FIFO", "expected a regular file", entries=DIRECTORY)
def format2_fifo_as_the_manifest(case: Case) -> Path:
    d = case.copy("ckpt2")
    (d / MANIFEST_NAME).unlink()
    os.mkfifo(d / MANIFEST_NAME)
    return d


@attack("path", "ValueError", "a FIFO", "expected a regular file", entries=RANK_FILES)
def format2_fifo_as_a_rank_file(case: Case) -> Path:
    d = case.copy("ckpt2")
    path = A.rank_file(d, 1)
    path.unlink()
    os.mkfifo(path)
    return d


@attack("path", "ValueError", "a symbolic link", "expected a regular file", entries=RANK_FILES)
def format2_rank_file_symlinked_out_of_the_directory(case: Case) -> Path:
    d = case.copy("ckpt2")
    path = A.rank_file(d, 1)
    outside = case.where / "elsewhere.safetensors"
    path.rename(outside)
    path.symlink_to(outside)
    return d


@attack("writer", "ForeignOutputError", "manifest.json is not an fsdp_optim manifest", entries=("reshard into",))
def format2_reshard_into_a_directory_with_a_foreign_manifest(case: Case) -> Path:
    case.out.mkdir()
    (case.out / MANIFEST_NAME).write_text('{"model": "someone else\'s"}')
    return case.copy("ckpt2")


@attack("writer", "ForeignOutputError", "manifest.json is not an fsdp_optim manifest", "even with overwrite",
        entries=("reshard into, overwrite", "cli reshard into, overwrite"))
def format3_reshard_with_overwrite_over_a_foreign_manifest(case: Case) -> Path:
    case.out.mkdir()
    (case.out / MANIFEST_NAME).write_text('{"model": "someone else\'s"}')  # our commit would rename over it
    return case.copy("ckpt2")


@attack("writer", "ValueError", "one of the inputs", entries=("cli consolidate into its own manifest",))
def format2_consolidate_output_is_its_own_manifest(case: Case) -> Path:
    return case.copy("ckpt2")


# --- running an attack -----------------------------------------------------------------------------------


def _call(entry: str, given: Any, case: Case, attack: Attack) -> A.Outcome:
    out, layout, full = str(case.out), case.layout, str(case.saved / "full.pt")
    builder = attack.extra.get("builder")
    calls: dict[str, Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]] = {
        "consolidate": lambda: (A.consolidate_entry, (str(given),)),
        "reshard": lambda: (A.reshard_entry, (str(given), 3, out)),
        "load": lambda: (A.load_full_entry, (str(given),)),
        "reshard full": lambda: (A.reshard_entry, (str(given), 3, out, layout)),
        "cli consolidate": lambda: (A.cli_entry, ("consolidate", str(given), "-o", f"{out}/full.pt")),
        "cli inspect": lambda: (A.cli_entry, ("inspect", str(given), "--units")),
        "cli verify": lambda: (A.cli_entry, ("verify", str(given))),
        "cli reshard": lambda: (A.cli_entry, ("reshard", str(given), "--world-size", "3", "-o", out)),
        "cli convert": lambda: (A.cli_entry, ("convert", str(given), "--to", "named", "-o", f"{out}/named.pt")),
        "reshard dict": lambda: (A.reshard_built, (builder, full, 3, out, layout)),
        "to_named": lambda: (A.to_named_built, (builder, full)),
        "reshard to a million ranks": lambda: (A.reshard_entry, (str(given), 10**6, out)),
        "reshard into a symlink to the source": lambda: (A.reshard_entry, (str(given), 3, str(case.where / "alias"))),
        "cli consolidate into its own manifest": lambda: (
            A.cli_entry, ("consolidate", str(given), "-o", str(Path(given) / A.manifest_of(Path(given))))
        ),
        "cli convert into a hard link of its source": lambda: (
            A.cli_entry, ("convert", str(given), "--to", "named", "-o", str(case.where / "link.pt"))
        ),
        "reshard into": lambda: (A.reshard_entry, (str(given), 3, out)),
        "reshard with it as the layout": lambda: (A.reshard_entry, (full, 3, out, str(Path(given) / MANIFEST_NAME))),
        "cli reshard with it as the layout": lambda: (
            A.cli_entry, ("reshard", full, "--world-size", "3", "--layout", str(Path(given) / MANIFEST_NAME), "-o", out)
        ),
        "reshard into, overwrite": lambda: (A.reshard_entry, (str(given), 3, out, None, True)),
        "cli reshard into, overwrite": lambda: (
            A.cli_entry, ("reshard", str(given), "--world-size", "3", "-o", out, "--overwrite")
        ),
    }
    fn, args = calls[entry]()
    return A.bounded(fn, *args)


def _check(entry: str, outcome: A.Outcome, attack: Attack, case: Case) -> None:
    assert outcome.kind in ("ok", "raised"), f"{entry}: {outcome}"  # not killed: bounded in time and memory
    if entry.startswith("cli"):
        assert outcome.kind == "ok", f"{entry}: the CLI itself raised: {outcome}"
        code, text, err = outcome.value
        report = entry == "cli verify"  # verify reports each file on stdout, then fails naming the damaged ones
        assert code == 1 and (text == "" or report), f"{entry}: exit {code}, stdout {text!r}, stderr {err!r}"
        assert err.startswith(CLI_ERROR) and err.count("\n") == 1 and "Traceback" not in err, f"{entry}: {err!r}"
        assert not any(ord(c) < 0x20 for c in err[:-1]), f"{entry}: a raw control character: {err!r}"
        if attack.cls == "names":
            assert "\\x1b[2J" in err, f"{entry}: the name is not shown escaped: {err!r}"
        return
    assert outcome.kind == "raised" and any(e in outcome.bases for e in attack.error), (
        f"{entry}: expected {attack.error}, got {outcome}"
    )
    missing = [m for m in attack.mentions if m not in outcome.message]
    assert not missing, f"{entry}: the message lacks {missing}: {outcome.message!r}"


def _params() -> list[Any]:
    return [
        pytest.param(name, entry, id=f"{a.cls}-{name}-{entry.replace(' ', '_')}")
        for name, a in ATTACKS.items()
        for entry in a.entries
    ]


@pytest.fixture(scope="module")
def bomb(saved: Path) -> Path:
    """A full dict file whose storage declares 1 GiB and is stored deflated (about 1 MiB on disk)."""
    return A.write_deflate_bomb(saved.parent / "bomb.pt", 1 << 30)


@pytest.mark.parametrize("name, entry", _params())
def test_attack_is_refused_clearly_in_bounds_and_changes_nothing(
    name: str, entry: str, saved: Path, bomb: Path, tmp_path: Path
) -> None:
    attack = ATTACKS[name]
    case = Case(saved, tmp_path)
    given = attack.make(case)
    before = A.tree_digest(tmp_path)
    outcome = _call(entry, given, case, attack)
    _check(entry, outcome, attack, case)
    changed = A.difference(before, A.tree_digest(tmp_path))
    assert not changed, f"{entry}: changed on disk: {changed}"


def test_catalogue_is_large_enough() -> None:
    by_class: dict[str, int] = {}
    for a in ATTACKS.values():
        by_class[a.cls] = by_class.get(a.cls, 0) + 1
    assert len(ATTACKS) >= 40 and len(by_class) >= 6, by_class


@pytest.mark.parametrize("name", ["ckpt", "ckpt2"])
def test_escaped_names_are_printed_escaped(name: str, saved: Path, tmp_path: Path) -> None:
    """``inspect --units`` of a checkpoint (format 1, 2) whose unit and parameter names carry control sequences."""
    d = Case(saved, tmp_path).copy(name)

    def rename(body: dict[str, Any]) -> None:
        hostile = "block1\x1b]0;owned\x07\x1b[2J"
        for flat in body["flat_params"]:
            if flat["unit"] == "block1":
                flat["unit"] = hostile

    (A.forge_manifest_json if name == "ckpt2" else A.forge_manifest)(d, rename)
    outcome = A.bounded(A.cli_entry, "inspect", str(d), "--units")
    code, text, err = outcome.value
    assert code == 0 and err == "", err
    assert "\x1b" not in text and "\x07" not in text and "block1\\x1b]0;owned\\x07\\x1b[2J" in text, text


def test_a_step_out_of_every_float_range_is_shown_or_refused_never_a_traceback(saved: Path, tmp_path: Path) -> None:
    """A ``step`` of ``10**400`` (valid JSON, checksum right): ``inspect`` shows it, and what cannot hold it
    refuses it clearly; no ``OverflowError`` out of the CLI (exit 70)."""
    d = Case(saved, tmp_path).copy("ckpt2")

    def huge(body: dict[str, Any]) -> None:
        for flat in body["flat_params"]:
            for e in flat["state"]:
                if e["key"] == "step":
                    e["value"] = 10**400

    A.forge_manifest_json(d, huge, raw=True)
    code, text, err = A.bounded(A.cli_entry, "inspect", str(d), "--units").value
    assert code == 0 and err == "" and "step" in text and "(401 digits)" in text, (code, text, err)
    out = tmp_path / "out"
    for argv in (("consolidate", str(d), "-o", str(out / "full.pt")), ("reshard", str(d), "--world-size", "3", "-o", str(out))):
        code, _, err = A.bounded(A.cli_entry, *argv).value
        assert code in (0, 1) and "Traceback" not in err, (argv[0], code, err)
        assert code == 0 or (err.startswith(CLI_ERROR) and err.count("\n") == 1), (argv[0], err)


@pytest.mark.parametrize("content", ["holes", "one long string"])
def test_reading_a_large_manifest_costs_a_small_multiple_of_its_bytes(saved: Path, tmp_path: Path, content: str) -> None:
    """A format-3 manifest of ~60 MB under the cap (``MAX_MANIFEST_BYTES``): a sparse file (header as written,
    then holes: its checksum cannot match) or a valid one (checksum right) holding one long string.
    ``inspect`` grows by at most 3x the file + 64 MiB (it copied and hashed the ``repr`` of the text: 5-11x)."""
    from fsdp_optim.formats.sharded.manifest_json import MAX_MANIFEST_BYTES

    d = Case(saved, tmp_path).copy("ckpt2")
    size = min(60_000_000, MAX_MANIFEST_BYTES - (1 << 20))
    if content == "holes":
        head = (d / MANIFEST_NAME).read_bytes().partition(b',"body":')[0] + b',"body":'
        with open(d / MANIFEST_NAME, "r+b") as f:
            f.truncate(size)  # holes: NUL bytes that take no disk
            f.write(head)
            f.seek(size - 2)
            f.write(b"}\n")
    else:
        long = "x" * size
        A.forge_manifest_json(d, lambda body: body["param_groups"][0]["hyperparams"].update(note=long), raw=True)
    nbytes = (d / MANIFEST_NAME).stat().st_size
    outcome = A.bounded(A.cli_peak_entry, "inspect", str(d), memory=4 << 30)
    assert outcome.kind == "ok", outcome
    code, err, growth = outcome.value
    assert code in (0, 1) and "Traceback" not in err, (code, err)
    assert growth <= 3 * nbytes + (64 << 20), f"{content}: {nbytes} bytes of manifest, peak RSS grew {growth} bytes"


def test_overwrite_writes_beside_foreign_files_and_keeps_them(saved: Path, tmp_path: Path) -> None:
    case = Case(saved, tmp_path)
    source = reshard_into_a_directory_of_someone_elses_files(case)
    before = {p.name: p.read_bytes() for p in case.out.iterdir()}
    outcome = A.bounded(A.reshard_entry, str(source), 3, str(case.out), None, True)
    assert outcome.kind == "ok", outcome
    assert {n: (case.out / n).read_bytes() for n in before} == before, "a foreign file changed"
    again = A.bounded(A.reshard_entry, str(tmp_path / "ckpt"), 2, str(case.out), None, True)
    assert again.kind == "ok", again
    assert {n: (case.out / n).read_bytes() for n in before} == before, "a foreign file was removed by the next commit"
    assert A.bounded(A.consolidate_entry, str(case.out)).kind == "ok"


# --- the property: mutated real checkpoint files give only documented errors, in bounds ----------------

MUTATIONS = ("flip", "truncate", "insert", "zero", "structure", "structure, checksums recomputed")


@settings(max_examples=48, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_mutated_checkpoints_raise_only_documented_errors_in_bounds(saved: Path, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    name = data.draw(st.sampled_from(["ckpt", "ckpt2"]), label="format")
    where = saved.parent / f"mutated-{seed}-{MUTATIONS.index(kind)}-{name}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    d = Path(shutil.copytree(saved / name, where / "ckpt"))
    if A.bounded(A.mutate, d, seed, kind).kind != "ok":
        shutil.rmtree(where)
        return  # a mutation torch.save would not write: nothing to test
    before = A.tree_digest(where)
    for fn, args in ((A.consolidate_entry, (str(d),)), (A.cli_entry, ("inspect", str(d)))):
        outcome = A.bounded(fn, *args)
        assert outcome.kind in ("ok", "raised"), f"{kind} (seed {seed}): {fn.__name__}: {outcome}"
        if fn is A.cli_entry:
            code, _, err = outcome.value
            assert code in (0, 1) and "Traceback" not in err, f"{kind} (seed {seed}): {err}"
        else:
            assert outcome.kind == "ok" or outcome.documented(), f"{kind} (seed {seed}): {outcome}"
    assert not A.difference(before, A.tree_digest(where)), f"{kind} (seed {seed}): changed on disk"
    shutil.rmtree(where)


@settings(max_examples=24, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_full_dicts_give_the_cli_only_clear_errors(saved: Path, seed: int) -> None:
    where = saved.parent / f"mutated-full-{seed}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    path = Path(shutil.copy2(saved / "full.pt", where / "full.pt"))
    if A.bounded(A.mutate_full, path, seed).kind != "ok":
        shutil.rmtree(where)
        return
    before = A.tree_digest(where)
    for argv in (
        ("inspect", str(path)),
        ("convert", str(path), "--to", "named", "-o", str(where / "out" / "named.pt")),
        ("reshard", str(path), "--world-size", "3", "--layout", str(saved / "layout.pt"), "-o", str(where / "out")),
    ):
        outcome = A.bounded(A.cli_entry, *argv)
        assert outcome.kind == "ok", f"seed {seed}: {argv[0]}: {outcome}"
        code, _, err = outcome.value
        assert code in (0, 1) and "Traceback" not in err, f"seed {seed}: {argv[0]}: exit {code}: {err}"
        if code == 1:
            assert err.startswith(CLI_ERROR) and err.count("\n") == 1, f"seed {seed}: {argv[0]}: {err!r}"
        shutil.rmtree(where / "out", ignore_errors=True)
    assert not A.difference(before, A.tree_digest(where)), f"seed {seed}: changed on disk"
    shutil.rmtree(where)
