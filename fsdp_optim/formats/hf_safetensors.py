"""A model's weights by name as Hugging Face stores them: ``model.safetensors``, or above a size several
``model-00001-of-0000N.safetensors`` files with ``model.safetensors.index.json``, written one tensor at a time.

::

    out/model.safetensors                       # every tensor, when they fit max_shard_size
    out/model-00001-of-00002.safetensors        # else tensors in order, a new file whenever the next would
    out/model-00002-of-00002.safetensors        #   push the current one past max_shard_size (a larger tensor
    out/model.safetensors.index.json            #   gets a file of its own), and the index, written last:
        {"metadata": {"total_size": <bytes of all tensors>}, "weight_map": {"embed.weight": "model-00001-...", ...}}

Each file's ``__metadata__`` is ``{"format": "pt"}`` and sizes parse as ``transformers`` does (``"5GB"`` is 5 * 10**9
bytes, ``"5GiB"`` 5 * 2**30, an int is bytes). Each tensor is made, written and dropped: memory is one tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.save import Survey
from fsdp_optim.formats.safetensors_container import (
    Tensor,
    data_bytes,
    encode_header,
    read_file_header,
)

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "HF_DIRECTORY", "INDEX", "OPTIMIZER", "SINGLE", "NewDirectoryClaims", "is_hf_directory",
    "is_plain", "model_files", "parse_size", "read_model", "shard", "write_hf_file",
]  # fmt: skip

DEFAULT_MAX_SHARD_SIZE = "5GB"
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
OPTIMIZER = "optimizer.safetensors"  # beside the model files: the optimizer state by parameter name (a named file)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str, *, name: str = "max_shard_size") -> int:
    """Bytes of ``size`` (``"5GB"``, ``"500MiB"``, ``1000``); ``ValueError`` naming ``name`` for anything else."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if match is None:
            raise ValueError(f"{name}: expected bytes as an int or a size such as '5GB' or '500MiB', found {size!r}")
        value = int(float(match[1]) * _UNITS[match[2] or ""])
    if value <= 0:
        raise ValueError(f"{name}: expected a positive size, found {size!r}")
    return value


def shard(tensors: Sequence[Tensor], max_bytes: int) -> list[list[Tensor]]:
    """Tensors in order, a new group whenever the next would push the current one past ``max_bytes``."""
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_hf_file(f: BinaryIO, tensors: Sequence[Tensor], after: Callable[[], None] | None = None) -> None:
    """One safetensors file of ``tensors``: the header from their shapes, then each made, written and dropped."""
    f.write(encode_header({"format": "pt"}, ((t.name, t.dtype, t.shape) for t in tensors)))
    for t in tensors:
        f.write(data_bytes(t.made()))
        if after is not None:
            after()


def index(groups: Sequence[Sequence[Tensor]]) -> bytes:
    """``model.safetensors.index.json`` of several files (``transformers``' shape)."""
    names = file_names(len(groups))
    weight_map = {t.name: names[i] for i, group in enumerate(groups) for t in group}
    total = sum(t.nbytes for group in groups for t in group)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()


@dataclass(frozen=True)
class NewDirectoryClaims:
    """An output directory that must be new or empty (for :mod:`fsdp_optim.disk.local_directory`; what is there is
    foreign: refused without overwrite, kept with it): a write creates the names its journal entry lists (or
    ``creates``), those matching ``pattern`` are ours; once one of ``commit`` (moved in last) is there, everything is
    kept."""

    pattern: re.Pattern[str]
    commit: frozenset[str]
    overwrite_means: str
    creates: frozenset[str] = frozenset()

    def survey(self, directory: Path) -> Survey:  # noqa: ARG002 - nothing in an existing directory is ours
        return Survey(overwrite_means=self.overwrite_means)

    def created(self, entry: JournalEntry) -> set[str]:
        return {n for n in entry.files or self.creates if self.pattern.match(n)}

    def tagged(self, entry: JournalEntry) -> set[tuple[str, str]]:  # noqa: ARG002
        return set()

    def referenced(self, directory: Path) -> set[str]:
        names = set(os.listdir(directory))
        return names if self.commit & names else set()

    def deletable(self, name: str) -> bool:
        return self.pattern.match(name) is not None


HF_DIRECTORY = NewDirectoryClaims(
    re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|optimizer\.safetensors)$"),
    frozenset({SINGLE, INDEX}), "write there anyway (files of the same names are replaced)")


# ---------------------------------------------------------------------------------------------------
# Reading the layout back (inspect, diff, verify): its files, and every tensor of them


def is_hf_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory of this layout (it holds ``model.safetensors`` or the index)."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, SINGLE)) or
                                    os.path.isfile(os.path.join(path, INDEX)))  # fmt: skip


def is_plain(path: str | os.PathLike[str]) -> bool:
    """Whether the safetensors file ``path`` has a readable header without fsdp_optim's metadata (a model's weights
    as Hugging Face stores them, not a named optimizer file of ours); a header that cannot be read: ``False``."""
    try:
        return "fsdp_optim" not in read_file_header(path).metadata
    except (OSError, ValueError):
        return False


def model_files(path: str | os.PathLike[str]) -> list[Path]:
    """The model files of ``path``: itself (one file), or a directory's ``model.safetensors`` or the files its index
    names, in order; ``ValueError`` for an index that is not this layout's."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    if (path / SINGLE).is_file() or not (path / INDEX).is_file():
        return [path / SINGLE]
    try:
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        expected = "{'weight_map': {name: file}}, as transformers writes"
        raise ValueError(f"{path / INDEX}: expected {expected} ({exc})") from None
    bad = next((n for n in names if not isinstance(n, str) or "/" in n or n.startswith(".")), None)
    if bad is not None:
        raise ValueError(f"{path / INDEX}: names the file {bad!r}, expected a file name beside the index")
    return [path / n for n in names]


def read_model(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the model files of ``path`` (:func:`model_files`), in file then header order, each copied out
    of the file's mapping; each header checked first. The layout records no checksums: what is checked is the
    header (dtypes, shapes against offsets, no overlap or gap) and that every byte reads."""
    from safetensors import safe_open  # (a model read: the only use of the library here)

    out: dict[str, torch.Tensor] = {}
    for file in model_files(path):
        header = read_file_header(file)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in header.tensors:
                if name in out:
                    raise ValueError(f"{file}: tensor '{name}' is in two model files")
                out[name] = f.get_tensor(name).clone()
    return out
