"""What kind of input a path or a dict is, decided in one function (:func:`detect`; :func:`path_kind` is its
part that reads no file, which ``verify`` asks of a damaged checkpoint). Which kinds a live model takes as a full
dict is decided here too (:func:`full_file_source`). (A job's ``load_sharded_optim_state`` asks only a path's name
which way to read it: other ranks may not see a file on ``src_rank``, so no rank may open it to classify it.)
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

import torch

from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.preconditions import check_full_dict, is_full_dict
from fsdp_optim.core.source import Source
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.objects import check_tree
from fsdp_optim.disk.untrusted import load_file
from fsdp_optim.formats.fairscale import dict_source, is_fairscale_native, is_named_dict
from fsdp_optim.formats.fairseq.paths import is_shard_set
from fsdp_optim.formats.hf_safetensors import is_hf_directory, is_plain
from fsdp_optim.formats.sharded.file_record import HEADER_KEY
from fsdp_optim.formats.sharded.locate import is_json_manifest, source_kind
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.whole_file import TIED_KEY, is_whole_file

__all__ = [
    "RANK_FILE_NAME",
    "Given",
    "Kind",
    "detect",
    "full_file_source",
    "loaded_kind",
    "names_shard_set",
    "path_kind",
    "sniff_kind",
]


class Kind(enum.Enum):
    SHARDED = "sharded checkpoint"
    LAYOUT = "layout file"
    RANK_FILE = "rank file of a sharded checkpoint"
    FULL = "full dict"
    NATIVE = "fairscale-native dict"
    SHARD_SET = "fairseq/metaseq shard set"
    NAMED = "named safetensors file"
    NAMED_DICT = "name-keyed dict (convert --to named, for FSDP2's set_optimizer_state_dict)"
    DCP = "PyTorch DCP checkpoint"
    WHOLE_FILE = "consolidated whole checkpoint file ({'model', 'optimizer', 'extra'})"
    HF = "Hugging Face safetensors model (model.safetensors or its shards and index; optimizer.safetensors beside)"


RANK_FILE_NAME = re.compile(r"^optim-[0-9a-f]+-rank\d+-of-\d+\.(pt|safetensors)$")

# What a caller hands in: a path (or a URL) to read, or a dict already in memory.
Given: TypeAlias = str | os.PathLike[str] | Mapping[str, Any]


def detect(given: Given) -> tuple[Kind, Any]:
    """The kind of ``given`` and, for a file, its loaded content (memory-mapped, through the untrusted gate).

    Raises ``FileNotFoundError`` for nothing there and ``ValueError`` naming what was found otherwise."""
    if isinstance(given, Mapping):
        if is_whole_file(given):
            return Kind.WHOLE_FILE, given
        return (Kind.NATIVE if is_fairscale_native(given) else Kind.FULL), given
    kind = path_kind(given) or sniff_kind(given)
    if kind is not None:
        return kind, None
    # What the file is comes first: a model's state_dict() with tied weights is "not a checkpoint", not "shares
    # memory". Tensors sharing memory are checked once it is one of ours (a whole checkpoint's model may name a tied
    # parameter twice); every other check of the gate holds before anything is classified.
    obj = load_file(given, mmap=True, shared=True)
    kind = loaded_kind(obj, str(given))
    check_tree(obj, str(given), disjoint=True, tied=TIED_KEY)
    return kind, obj


def loaded_kind(obj: Any, where: str) -> Kind:
    """The kind of what a torch file held (loaded through the gate), or a refusal that says it is not a checkpoint
    and what it looks like."""
    if is_whole_file(obj):
        return Kind.WHOLE_FILE
    header = obj.get(HEADER_KEY) if isinstance(obj, Mapping) else None
    if isinstance(header, Mapping) and header.get("kind") in ("manifest", "shard"):
        return Kind.LAYOUT if header["kind"] == "manifest" else Kind.RANK_FILE
    if is_fairscale_native(obj):
        return Kind.NATIVE
    if is_full_dict(obj):
        return Kind.FULL
    if is_named_dict(obj):
        return Kind.NAMED_DICT
    looks = _looks_like(obj)
    if looks is not None:
        raise (ValueError if isinstance(obj, Mapping) else TypeError)(
            f"{where}: not a checkpoint: it looks like {looks}; expected a full optimizer state dict with 'state', "
            "'param_groups' and 'param_names', a sharded checkpoint directory or another input fsdp-optim reads "
            "(fsdp-optim --help lists them)"
        )
    check_full_dict(obj, where)  # an optimizer's dict short of a key: says what it expected and what it holds
    return Kind.FULL


def _looks_like(obj: Any) -> str | None:
    """What a loaded object that is no checkpoint looks like (``None``: an optimizer state dict of some kind)."""
    if isinstance(obj, Mapping) and "state" in obj:
        return None
    if isinstance(obj, Mapping):
        keys = sorted(map(str, obj))
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        if obj and all(torch.is_tensor(v) for v in obj.values()):
            return (f"a model's state_dict() ({len(keys)} tensors keyed by name: {shown}), which holds no optimizer "
                    "state")
        return f"a dict without optimizer state (keys: {shown or '-'})"
    return f"a {'tensor' if torch.is_tensor(obj) else type(obj).__name__}, not a dict"


def full_file_source(path: str | os.PathLike[str], layout: ModelLayout, *, optimizer: str | None) -> Source:
    """The planning source of a file handed to a live model as its full dict: a file holding one (memory-mapped;
    fairscale's own gathered dict numbered by ``layout``, its class named by ``optimizer``), or a named safetensors
    file (read range by range, each range checked as it is read). Any other kind is refused, naming it."""
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{path}: no such file or directory; expected a sharded checkpoint directory (holding {MANIFEST_NAME}), "
            "a full dict file or a named safetensors file"
        )
    kind, obj = detect(path)
    if kind in (Kind.NAMED, Kind.HF):  # a safetensors file without our metadata: its reader says so
        from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors

        return NamedSafetensors(path).source()
    if kind not in (Kind.FULL, Kind.NATIVE):
        raise ValueError(
            f"{path}: a {kind.value}, not a full dict; load a sharded checkpoint with load_sharded_optim_state, or "
            "write a full dict first (fsdp-optim consolidate / convert)"
        )
    return dict_source(obj, layout, label=str(path), optimizer=optimizer)


def names_shard_set(given: Any) -> bool:
    """Whether ``given`` is a fairseq/metaseq shard set, by its names alone (a dict, a URL or a store never is; no
    file is read and nothing raises): who passes ``allow_globals`` asks this first."""
    if not isinstance(given, (str, os.PathLike)):
        return False
    try:
        files = _local_files(given)
    except ValueError:  # a URL of no known filesystem: no shard set either (opening it says why)
        return False
    return files is not None and is_shard_set(given)


def _local_files(path: str | os.PathLike[str]) -> Path | None:
    """The local directory or file ``path`` is, where its objects are local files; else None. A capability, not a
    backend: shard sets, DCP directories and Hugging Face layouts are read as local files by their readers."""
    return where(path).local_path()


def sniff_kind(path: str | os.PathLike[str]) -> Kind | None:
    """What a file that is no torch file is, by its name and first bytes (no ``torch.load``, so ``verify`` asks
    it too): a rank file of a checkpoint (safetensors, formats 2 and 3), a named safetensors file, a JSON layout
    file; ``None`` for anything else (a torch file: :func:`detect` loads it to say more)."""
    if RANK_FILE_NAME.match(Path(path).name) and Path(path).suffix == ".safetensors":
        return Kind.RANK_FILE  # read only through its checkpoint's manifest
    from fsdp_optim.formats.named_safetensors.reader import is_named_safetensors  # (imported for a file to sniff)

    if is_named_safetensors(path):  # any other safetensors file: ours, or a model's weights without our metadata
        return Kind.HF if is_plain(path) else Kind.NAMED
    if is_json_manifest(path):  # a layout file (save_layout writes a manifest without files, in JSON)
        return Kind.LAYOUT
    return None


def path_kind(path: str | os.PathLike[str]) -> Kind | None:
    """What a path is by its names alone (no file read): a shard set, a sharded checkpoint (in any location), a DCP
    directory, a Hugging Face layout, or ``None`` for a file whose content says the rest (:func:`detect`); nothing
    there, or a directory (a store's prefix) of neither, is refused (:func:`~.sharded.locate.source_kind`)."""
    files = _local_files(path)
    if files is not None and is_shard_set(path):
        return Kind.SHARD_SET
    if files is not None and files.is_dir() and (files / ".metadata").is_file():  # formats/dcp.METADATA (not imported)
        return Kind.DCP
    if files is not None and is_hf_directory(files):  # what convert --to safetensors writes of a whole checkpoint
        return Kind.HF
    return Kind.SHARDED if source_kind(path) == "sharded" else None
