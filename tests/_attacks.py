"""Tools of the adversarial suite: run an entry point in a bounded child process, forge hostile files.

**Bounded runs.** :func:`bounded` runs ``fn(*args)`` in a child forked from a ``multiprocessing``
forkserver that has already imported torch and fsdp_optim (a case costs a fork, not an interpreter),
with an address-space limit (``RLIMIT_AS``: the child's size at start plus ``memory`` bytes) and a
wall-clock timeout. It reports what ``fn`` returned or raised (type, its base classes, message), how
long it took and its peak RSS; a child that overruns is killed and reported as such. Nothing is mocked:
the child reads and writes real files.

**Forged files.** :func:`write_torch_zip` writes the ``torch.save`` zip format by hand (``data.pkl`` from
a real pickler, one record per storage) so a test can declare sizes, strides, globals, compression or
record offsets that ``torch.save`` itself would never write. :func:`forge_manifest` and
:func:`forge_rank_file` rewrite a real checkpoint's files with an edit applied and every checksum
recomputed, as a writer that knows the format would. :func:`tree_digest` hashes a directory tree
(names, kinds, bytes, symlink targets) to prove that nothing changed.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import random
import resource
import struct
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _dist import forkserver_context
from _forge import (
    forge_manifest,
    forge_manifest_json,
    forge_manifest_text,
    forge_rank_file,
    forge_safetensors,
    read_safetensors,
    to_format1,
)
from _forge import manifest_rank_file as rank_file

from fsdp_optim.core.checksums import digest
from fsdp_optim.formats.sharded.manifest import LEGACY_MANIFEST_NAME, MANIFEST_NAME

__all__ = ["forge_manifest", "forge_manifest_json", "forge_manifest_text", "forge_rank_file", "forge_safetensors", "rank_file", "to_format1"]


def manifest_of(directory: Path) -> str:
    """The name of the manifest in ``directory`` (format 2's, else format 1's)."""
    return MANIFEST_NAME if (directory / MANIFEST_NAME).exists() else LEGACY_MANIFEST_NAME

# What a child may raise: the documented exception types of fsdp_optim (and their subclasses).
DOCUMENTED = ("ValueError", "TypeError", "FileNotFoundError", "OSError", "NotImplementedError")
PRELOAD = ["torch", "torch._dynamo", "fairscale.nn", "fsdp_optim", "fsdp_optim.offline", "fsdp_optim.cli", "_attacks"]
DEFAULT_TIMEOUT_S = 60.0  # generous: the machine is shared; a bomb takes forever or dies of RLIMIT_AS
DEFAULT_MEMORY = 768 << 20  # address space a case may add to the child's (a real case needs a few MiB)


# ---------------------------------------------------------------------------------------------------
# Bounded runs


@dataclass
class Outcome:
    kind: str  # "ok", "raised", "timeout", "died"
    error: str = ""  # the exception's type name
    bases: tuple[str, ...] = ()  # names of its classes, most derived first
    message: str = ""
    value: Any = None
    seconds: float = 0.0
    peak_mib: float = 0.0
    where: str = ""  # traceback tail, for failures

    def documented(self) -> bool:
        return self.kind == "raised" and any(b in DOCUMENTED for b in self.bases)

    def __str__(self) -> str:
        head = f"{self.kind} {self.error}: {self.message}" if self.kind == "raised" else self.kind
        return f"{head} ({self.seconds:.2f} s, peak {self.peak_mib:.0f} MiB){self.where}"


def _context() -> Any:
    return forkserver_context(PRELOAD)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(fn: Callable[..., Any], args: tuple, conn: Any, memory: int) -> None:
    torch.set_num_threads(1)
    limit = _vm_size() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    start = time.perf_counter()
    try:
        value = fn(*args)
        out = Outcome("ok", value=value)
    except BaseException as exc:  # noqa: BLE001 - the kind is what the test checks
        out = Outcome(
            "raised",
            type(exc).__name__,
            tuple(c.__name__ for c in type(exc).__mro__),
            str(exc),
            where="\n" + "".join(traceback.format_exception(exc)[-6:]),
        )
    out.seconds = time.perf_counter() - start
    out.peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        conn.send(out)
    except Exception:  # noqa: BLE001 - an unpicklable value: report its type instead
        conn.send(Outcome(out.kind, out.error, out.bases, out.message, repr(type(out.value)), out.seconds, out.peak_mib))
    conn.close()


@dataclass
class Running:
    process: Any
    reader: Any
    started: float


def launch(fn: Callable[..., Any], *args: Any, memory: int = DEFAULT_MEMORY) -> Running:
    """Start ``fn(*args)`` in a forked child under ``RLIMIT_AS`` (+``memory``); :func:`collect` it."""
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(fn, args, writer, memory), daemon=True)
    started = time.perf_counter()
    process.start()
    writer.close()
    return Running(process, reader, started)


def collect(run: Running, timeout_s: float = DEFAULT_TIMEOUT_S) -> Outcome:
    """What a :func:`launch`-ed child did; killed and reported ``timeout`` if it takes longer."""
    try:
        if not run.reader.poll(timeout_s):
            run.process.kill()
            run.process.join()
            return Outcome("timeout", seconds=time.perf_counter() - run.started)
        try:
            out = run.reader.recv()
        except EOFError:
            run.process.join()
            return Outcome("died", message=f"exit code {run.process.exitcode}", seconds=time.perf_counter() - run.started)
    finally:
        run.reader.close()
    run.process.join()
    return out


def bounded(fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, memory: int = DEFAULT_MEMORY) -> Outcome:
    """``fn(*args)`` in a forked child under ``RLIMIT_AS`` (+``memory``) and ``timeout_s``; what happened."""
    return collect(launch(fn, *args, memory=memory), timeout_s)


# Entry points a child runs (module-level: the forkserver unpickles them by name).


def consolidate_entry(path: str) -> int:
    from fsdp_optim import consolidate

    return len(consolidate(path)["state"])


def reshard_entry(source: Any, world_size: int, out: str, layout: str | None = None, overwrite: bool = False) -> str:
    from fsdp_optim import reshard

    return str(reshard(source, world_size, out, layout=layout, overwrite=overwrite))


def to_named_entry(full: Any) -> int:
    from fsdp_optim import to_named

    return len(to_named(full)["state"])


def load_full_entry(path: str) -> int:
    from fsdp_optim.offline.operations import load_full_file

    return len(load_full_file(path)["state"])


def cli_entry(*argv: str) -> tuple[int, str, str]:
    """``fsdp-optim argv``: exit code, stdout, stderr (as text)."""
    from fsdp_optim.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = main(list(argv))
    finally:
        sys.stdout, sys.stderr = saved
    return code, out.getvalue(), err.getvalue()


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


def cli_peak_entry(*argv: str) -> tuple[int, str, int]:
    """``fsdp-optim argv`` (as :func:`cli_entry`) and its peak RSS growth in bytes (``VmHWM`` reset first,
    as ``benchmarks/peak.py`` measures): exit code, stderr, growth."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    code, _, err = cli_entry(*argv)
    return code, err, _status_bytes("VmHWM") - before


# ---------------------------------------------------------------------------------------------------
# Directory digests


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (``root`` itself excluded): relative path -> kind and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"symlink -> {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "dir"
            elif path.is_file():
                out[rel] = "file " + hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out


def difference(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


# ---------------------------------------------------------------------------------------------------
# Forging torch.save files by hand


@dataclass
class Storage:
    """A storage record: ``key`` names ``data/<key>``; ``declared`` elements are what the pickle claims."""

    key: str
    data: bytes
    dtype: str = "FloatStorage"
    declared: int | None = None  # default: len(data) // 4

    @property
    def numel(self) -> int:
        return self.declared if self.declared is not None else len(self.data) // 4


@dataclass
class Tensor:
    """A tensor over ``storage`` as the pickle describes it (any size and stride, no checks)."""

    storage: Storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0
    requires_grad: bool = False

    def __reduce__(self) -> Any:
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, self.offset, self.size, self.stride, self.requires_grad, collections.OrderedDict()),
        )


class Call:
    """A pickled call ``fn(*args)`` of a real global: what a hostile pickle can ask the unpickler to do."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Storage):
            return ("storage", getattr(torch, obj.dtype), obj.key, "cpu", obj.numel)
        return None


def pickle_bytes(obj: Any) -> bytes:
    """A protocol-2 pickle of ``obj`` as torch.save writes one (storages as persistent ids)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def write_torch_zip(
    path: Path,
    obj: Any,
    storages: list[Storage] = (),  # type: ignore[assignment]
    *,
    compress: int = zipfile.ZIP_STORED,
    pickle_data: bytes | None = None,
) -> Path:
    """A ``torch.save``-format zip holding ``obj`` (or the raw ``pickle_data``) and ``storages``."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle_data if pickle_data is not None else pickle_bytes(obj), compress_type=compress)
        z.writestr("archive/byteorder", "little")
        for s in storages:
            z.writestr(f"archive/data/{s.key}", s.data, compress_type=compress)
        z.writestr("archive/version", "3\n")
    return path


# forge_manifest / forge_rank_file: tests/_forge.py (shared with the refusal catalogue).


def patch_zip_entry(path: Path, name: str, *, size: int | None = None, header_offset_of: str | None = None) -> None:
    """Edit the central directory entry of record ``name`` in place: declare ``size`` bytes (compressed
    and uncompressed, local header too), or point it at the local header of record ``header_offset_of``.
    What a hand-made zip can say and ``zipfile`` or ``torch.save`` never would."""
    import struct

    raw = bytearray(path.read_bytes())
    eocd = raw.rfind(b"PK\x05\x06")
    count, _, cd_offset = struct.unpack("<HII", raw[eocd + 10 : eocd + 20])
    entries, pos = {}, cd_offset
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack("<HHH", raw[pos + 28 : pos + 34])
        entry_name = raw[pos + 46 : pos + 46 + name_len].decode()
        entries[entry_name] = pos
        pos += 46 + name_len + extra_len + comment_len
    target = entries[name]
    if size is not None:
        struct.pack_into("<II", raw, target + 20, size, size)
        local = struct.unpack("<I", raw[target + 42 : target + 46])[0]
        struct.pack_into("<II", raw, local + 18, size, size)
    if header_offset_of is not None:
        other = entries[header_offset_of]
        raw[target + 42 : target + 46] = raw[other + 42 : other + 46]
        raw[target + 16 : target + 28] = raw[other + 16 : other + 28]  # crc and sizes of the other record
    path.write_bytes(bytes(raw))


def nested_list_pickle(depth: int) -> bytes:
    """A pickle of ``depth`` lists each inside the next: a few bytes per level."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def doubling_pickle(depth: int) -> bytes:
    """A pickle of ``x = [x, x]`` applied ``depth`` times: linear in size, 2**depth references deep down."""
    out = bytearray(b"\x80\x02K\x01")  # the innermost object: 1
    for level in range(depth):
        out += b"q" + bytes([level % 256]) + b"h" + bytes([level % 256]) + b"\x86"  # BINPUT, BINGET, TUPLE2
    return bytes(out + b".")


def cyclic_pickle() -> bytes:
    """A pickle of a list that contains itself."""
    return b"\x80\x02]q\x00h\x00a."


def write_deflate_bomb(path: Path, nbytes: int) -> Path:
    """A torch.save-format file whose one storage declares ``nbytes`` and is stored deflated: zeros,
    about 1/1000 of that on disk; a reader that inflates it allocates all of it."""
    storage = Storage("0", b"", declared=nbytes // 4)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle_bytes({"state": {0: {"exp_avg": Tensor(storage, (4,), (1,))}}}))
        z.writestr("archive/byteorder", "little")
        info = zipfile.ZipInfo("archive/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            chunk = bytes(16 << 20)
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
        z.writestr("archive/version", "3\n")
    return path


# In-memory full dicts, built in the child from the real one (a dict 100k deep could not even be
# pickled to the child): name -> edit.


def _first_id(full: dict[str, Any], name: str) -> Any:
    return next(i for i, n in full["param_names"].items() if n == name)


def _deep(full: dict[str, Any]) -> None:
    value: Any = 0.9
    for _ in range(40):
        value = [value]
    full["param_groups"][0]["betas"] = value


BUILDERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "deep": _deep,
    "list_id": lambda full: full["param_groups"][0]["params"].append([1, 2]),
    "int_key": lambda full: full["state"][_first_id(full, "norm.weight")].__setitem__(3, torch.zeros(())),
    "float_id": lambda full: full["state"].__setitem__(1.5, {}),
    "str_group": lambda full: full["param_groups"].__setitem__(0, "lr=0.1"),
    "vector_step": lambda full: full["state"][_first_id(full, "norm.weight")].__setitem__("step", torch.zeros(3)),
}


def _built(builder: str, full_path: str) -> dict[str, Any]:
    full = torch.load(full_path, weights_only=True)
    BUILDERS[builder](full)
    return full


def reshard_built(builder: str, full_path: str, world_size: int, out: str, layout: str) -> str:
    from fsdp_optim import reshard

    return str(reshard(_built(builder, full_path), world_size, out, layout=layout))


def to_named_built(builder: str, full_path: str) -> int:
    from fsdp_optim import to_named

    return len(to_named(_built(builder, full_path))["state"])


# ---------------------------------------------------------------------------------------------------
# Mutations of real checkpoint files (the hypothesis property runs them in a bounded child too)


def _mutate_bytes(path: Path, rng: random.Random, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del data[rng.randrange(len(data)) :]
    elif how == "insert":
        at = rng.randrange(len(data))
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif how == "zero":
        at = rng.randrange(len(data))
        data[at : at + rng.randint(1, 4096)] = bytes(min(4096, len(data) - at))
    path.write_bytes(bytes(data))


_VALUES: list[Callable[[random.Random], Any]] = [
    lambda r: None,
    lambda r: r.randint(-(2**70), 2**70),
    lambda r: float("nan"),
    lambda r: "x" * r.randint(0, 50),
    lambda r: [],
    lambda r: {},
    lambda r: (1, [2, {3: 4}]),
    lambda r: torch.tensor(float("inf")),
    lambda r: torch.zeros(r.randint(0, 5), r.randint(1, 3)),
    lambda r: torch.zeros(1).expand(r.randint(2, 1 << 16)),  # small: the mutation runs unchecked
    lambda r: torch.zeros(3, dtype=torch.int64),
]


def _mutate_structure(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """``value`` with one node somewhere inside replaced, removed or retyped."""
    if isinstance(value, dict) and value and depth < 6 and rng.random() < 0.8:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.15:
            del out[key]
        elif roll < 0.25:
            out[rng.choice([7, "k", 2.5, None])] = out[key]
        else:
            out[key] = _mutate_structure(value[key], rng, depth + 1)
        return out
    if isinstance(value, (list, tuple)) and value and depth < 6 and rng.random() < 0.8:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        out_list[i] = _mutate_structure(out_list[i], rng, depth + 1)
        return type(value)(out_list) if isinstance(value, tuple) else out_list
    return rng.choice(_VALUES)(rng)


def mutate(directory: Path, seed: int, kind: str) -> None:
    rng = random.Random(seed)
    files = sorted(p for p in directory.iterdir())
    target = rng.choice(files)
    if kind in ("flip", "truncate", "insert", "zero"):
        _mutate_bytes(target, rng, kind)
        return
    if target.name == LEGACY_MANIFEST_NAME:
        forge_manifest(directory, lambda body: body.update(_mutate_structure(body, rng)))
        return
    if target.name == MANIFEST_NAME:  # structure (checksum recomputed either way: it is the manifest's own)
        forge_manifest_json(directory, lambda body: body.update(_mutate_structure(body, rng)))
        return
    rank = next(r for r in range(64) if rank_file(directory, r) == target)
    if target.suffix == ".safetensors":  # its header, with (or without) the manifest's record updated
        if kind == "structure, checksums recomputed":
            forge_safetensors(directory, rank, lambda header: header.update(_mutate_structure(header, rng)))
        else:
            header, data = read_safetensors(target)
            text = json.dumps(_mutate_structure(header, rng)).encode()
            target.write_bytes(struct.pack("<Q", len(text)) + text + data)
        return
    if kind == "structure, checksums recomputed":
        forge_rank_file(directory, rank, lambda state: state.update(_mutate_structure(state, rng)))
    else:
        payload = torch.load(target, weights_only=True)
        torch.save(_mutate_structure(payload, rng), target)


# ---------------------------------------------------------------------------------------------------
# Writers for the concurrency tests: real processes, real files (tests/test_writers.py)


def slow_reshard(
    source: str, world_size: int, out: str, delay_s: float, started: str, env: dict[str, str], hold: str = ""
) -> str:
    """``reshard`` that sleeps ``delay_s`` after each unit and touches ``started`` after the first one
    (by then it holds the lock and is writing), so a test can collide with it or kill it there; with ``hold``, it
    also waits after its first unit until that file exists (at most 120 s), so a colliding process that starts
    slowly on a loaded machine still finds it writing."""
    os.environ.update(env)
    from fsdp_optim import reshard

    def progress() -> None:
        Path(started).touch()
        deadline = time.monotonic() + 120
        while hold and not Path(hold).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay_s)

    return str(reshard(source, world_size, out, progress=progress))


def save_job(directory: str, seed: int, saves: int, report: str, env: dict[str, str]) -> None:
    """A world-size-1 fairscale FSDP job (gloo, its own file store) that trains and saves into
    ``directory`` ``saves`` times, appending one JSON line per attempt to ``report``: whether it
    returned or raised (type), the digest of the state it saved, and when it finished."""
    import json

    import _models as M
    import torch.distributed as dist

    from fsdp_optim import save_sharded_optim_state

    os.environ.update(env)
    store = f"{report}.store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        model = M.wrap(M.make_net(seed), "deep")
        optim = M.OPTIMIZERS["adamw"](M.fsdp_param_groups(model))
        for k in range(saves):
            M.train_step(model, optim, *M.local_batch(k + seed, 0, 1))
            state = digest(model.gather_full_optim_state_dict(optim))
            try:
                save_sharded_optim_state(model, optim, directory)
                line = {"seed": seed, "k": k, "ok": True, "digest": state}
            except Exception as exc:  # noqa: BLE001 - reported, the test judges it
                line = {"seed": seed, "k": k, "ok": False, "error": type(exc).__name__, "message": str(exc)}
            line["t"] = time.time()
            with open(report, "a") as f:
                f.write(json.dumps(line) + "\n")
    finally:
        dist.destroy_process_group()


def hold_lock(output: str, purpose: str, held: str, env: dict[str, str]) -> None:
    """Take ``output``'s lock, touch ``held``, and keep it until killed."""
    os.environ.update(env)
    from fsdp_optim.disk.locks import lock_output

    lock = lock_output(output, purpose=purpose)  # noqa: F841 - held until the process dies
    Path(held).touch()
    while True:
        time.sleep(1)


def wait_for(path: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    stop = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > stop:
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def mutate_full(path: Path, seed: int) -> None:
    """Rewrite the full dict file at ``path`` with one node somewhere inside replaced, removed or retyped."""
    rng = random.Random(seed)
    torch.save(_mutate_structure(torch.load(path, weights_only=True), rng), path)
