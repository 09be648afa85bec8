"""The memory tier on disk: one directory per node in host memory (tmpfs), one step directory per saved step.

    <memory_dir>/node-<node>/step-00000042-<save id 12 hex>/
        manifest.json                                         # every node holds the step's manifest
        optim-<id>-rank00002-of-00008.safetensors             # this node's own ranks' files ...
        train-<id>-rank00002-of-00008.safetensors
        optim-<id>-rank00000-of-00008.safetensors             # ... and the replicas it keeps for other nodes
        COMPLETE.json                                         # written last, once every part and replica is in

A step directory is a whole checkpoint's directory that may lack the files of ranks this node does not hold.
``COMPLETE.json`` ({"version": 1, "step": 42, "save_id": "...", "world_size": 8, "node": "1", "files": {name:
bytes, ...every file of the step}, "held": [names this node holds]}) makes it visible: a directory without one is a
save that did not finish. The save id in its name keeps a step saved again (a resumed run) apart.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fsdp_optim.core.memory_plan import Holding
from fsdp_optim.core.steps import step_dir_name
from fsdp_optim.disk.atomic import atomic_write
from fsdp_optim.disk.json_input import loads
from fsdp_optim.disk.location import Location, identity
from fsdp_optim.disk.locations import where

__all__ = [
    "MARKER_NAME",
    "Marker",
    "default_memory_dir",
    "node_dir",
    "node_name",
    "prune_node",
    "read_holdings",
    "step_dirname",
    "tier_bytes",
    "write_marker",
]

MARKER_NAME = "COMPLETE.json"
MARKER_VERSION = 1
_MAX_MARKER_BYTES = 16 << 20
_STEP = re.compile(r"^step-(\d{8})-([0-9a-f]{12})$")
_NODE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Marker:
    """A node's ``COMPLETE.json`` for one step (see the module docstring)."""

    step: int
    save_id: str
    world_size: int
    node: str
    files: tuple[tuple[str, int], ...]  # (name, bytes) of every file of the step, sorted
    held: tuple[str, ...]  # the files of the step this node holds, sorted
    version: int = MARKER_VERSION

    def to_json(self) -> str:
        body = {
            "version": self.version, "step": self.step, "save_id": self.save_id, "world_size": self.world_size,
            "node": self.node, "files": dict(self.files), "held": list(self.held),
        }  # fmt: skip
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: bytes, where: str) -> Marker:
        d = loads(text, where=where)
        if not isinstance(d, dict) or d.get("version") != MARKER_VERSION:
            raise ValueError(f"{where}: expected a memory-tier marker of version {MARKER_VERSION}, found {str(d)[:80]}")
        files = d.get("files")
        held = d.get("held")
        if not isinstance(files, dict) or not isinstance(held, list) or not all(isinstance(n, str) for n in held):
            raise ValueError(f"{where}: expected 'files' an object {{name: bytes}} and 'held' a list of names")
        if not all(isinstance(v, int) and "/" not in k for k, v in files.items()):
            raise ValueError(f"{where}: 'files' must map plain file names to byte counts")
        step, save_id, world = d.get("step"), d.get("save_id"), d.get("world_size")
        if not isinstance(step, int) or not isinstance(save_id, str) or not isinstance(world, int):
            raise ValueError(f"{where}: expected int 'step', str 'save_id', int 'world_size', found {step!r}, "
                             f"{save_id!r}, {world!r}")  # fmt: skip
        return cls(step, save_id, world, str(d.get("node")), tuple(sorted(files.items())), tuple(sorted(held)))


def node_name(node: object) -> str:
    """A node's name as directories carry it: ``str(node)``."""
    name = str(node)
    if not _NODE.match(name):
        raise ValueError(f"node: expected a name of letters, digits, '_', '.', '-' (at most 64), found {name!r}")
    return name


def default_memory_dir(root: Path | Location) -> Path:
    """A manager's memory directory unless given: ``/dev/shm/fsdp_optim-<12 hex of its root's absolute path>`` (of
    its URL, for a root in an object store)."""
    name = identity(where(root))
    return Path("/dev/shm") / f"fsdp_optim-{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def node_dir(memory_dir: Path, node: str) -> Path:
    return memory_dir / f"node-{node}"


def step_dirname(step: int, save_id: str) -> str:
    """``step-00000042-3f2a9c0d1e2b``: the step and the first 12 hex digits of its save id."""
    return f"{step_dir_name(step)}-{save_id[:12]}"


def write_marker(directory: Path, marker: Marker) -> Path:
    """Write ``directory``'s marker atomically: the step becomes visible."""
    text = marker.to_json().encode()
    atomic_write(directory / MARKER_NAME, lambda f: f.write(text))
    return directory / MARKER_NAME


def _read_marker(directory: Path) -> Marker | None:
    path = directory / MARKER_NAME
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_MARKER_BYTES:
            return None
        return Marker.from_json(path.read_bytes(), str(path))
    except (OSError, ValueError):
        return None  # unreadable: this node does not hold that step


def read_holdings(node: Path) -> list[Holding]:
    """The complete steps node directory ``node`` holds, newest first: a marker, the manifest, and of the marker's
    ``held`` files those present with its size. Never raises: what cannot be read is not held."""
    out = []
    for directory in _step_dirs(node):
        marker = _read_marker(directory)
        if marker is None or not (directory / "manifest.json").is_file():
            continue
        sizes = dict(marker.files)
        held = frozenset(n for n in marker.held if n in sizes and _size(directory / n) == sizes[n])
        out.append(Holding(marker.step, marker.save_id, directory.name, marker.world_size, marker.files, held))
    return sorted(out, key=lambda h: (h.step, h.save_id), reverse=True)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() and not path.is_symlink() else None
    except OSError:
        return None


def _step_dirs(node: Path) -> list[Path]:
    try:
        names = sorted(n for n in (p.name for p in node.iterdir()) if _STEP.match(n))
    except OSError:
        return []
    return [node / n for n in names]


def prune_node(node: Path, *, keep: int) -> list[Path]:
    """Remove every step directory of ``node`` but its newest ``keep`` complete ones; the directories removed. Run by
    one rank of the node, with no save of that node in flight."""
    complete = {h.dirname for h in read_holdings(node)[:keep]}
    removed = []
    for directory in _step_dirs(node):
        if directory.name not in complete:
            (directory / MARKER_NAME).unlink(missing_ok=True)  # invisible first, then gone
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def tier_bytes(node: Path) -> int:
    """Bytes of the files in ``node``'s step directories (one pruned meanwhile counts as empty)."""
    total = 0
    for directory in _step_dirs(node):
        try:
            total += sum(s for s in (_size(p) for p in directory.iterdir()) if s is not None)
        except OSError:  # removed meanwhile: the node's first rank prunes while the others count
            continue
    return total
