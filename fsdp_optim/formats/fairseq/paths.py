"""A fairseq / metaseq shard set's file names: which paths name a set, its files in rank order, and what an
output directory of a set owns (:class:`SetClaims`, for :mod:`fsdp_optim.disk.local_directory`). Judged by names and
directory listings only: no file is opened here.

One file per rank, ``{prefix}-shard{r}.pt`` (metaseq: ``checkpoint_18-model_part-0-shard0.pt``; fairseq:
``checkpoint_last-shard0.pt``); a set is named by any of its files or by the path before ``-shard``
(``checkpoint_last`` or ``checkpoint_last.pt``). What a file holds: :mod:`fsdp_optim.formats.fairseq.files`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fsdp_optim.core.limits import MAX_WORLD_SIZE
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.save import Survey

__all__ = ["SetClaims", "is_shard_set", "shard_paths", "shard_siblings"]

_SHARD_FILE = re.compile(r"^(?P<prefix>.+)-shard(?P<rank>\d+)\.pt$")


def _prefix(path: Path) -> Path:
    match = _SHARD_FILE.match(path.name)
    if match:
        return path.with_name(match["prefix"])
    return (
        path.with_suffix("") if path.suffix == ".pt" else path
    )  # "checkpoint_last.pt" names "checkpoint_last-shard*.pt"


def shard_siblings(prefix: Path) -> dict[int, list[Path]]:
    """Files ``{prefix.name}-shard<r>.pt`` beside ``prefix``, by rank."""
    found: dict[int, list[Path]] = {}
    if prefix.parent.is_dir():
        for entry in prefix.parent.iterdir():
            match = _SHARD_FILE.match(entry.name)
            if match and match["prefix"] == prefix.name and entry.is_file():
                found.setdefault(int(match["rank"]), []).append(entry)
    return found


@dataclass(frozen=True)
class SetClaims:
    """What an output directory of a shard set named ``name`` owns (for :mod:`fsdp_optim.disk.local_directory`): its
    ``{name}-shard<r>.pt`` files. Other files (a fairseq checkpoint directory holds many) are never foreign, and
    never touched; an existing set of the same name is replaced only with ``overwrite``."""

    name: str

    def survey(self, directory: Path) -> Survey:
        existing = shard_siblings(directory / self.name)
        names = frozenset(p.name for files in existing.values() for p in files)
        problem = f"already holds {self.name}-shard<r>.pt files (ranks {sorted(existing)})" if existing else None
        known = frozenset(os.listdir(directory))
        return Survey(replaces=names, known=known, problem=problem, overwrite_means="replace them")

    def created(self, entry: JournalEntry) -> set[str]:
        world_size = entry.world_size
        if world_size is None or not 0 < world_size <= MAX_WORLD_SIZE:
            return set()
        return {f"{self.name}-shard{r}.pt" for r in range(world_size)}

    def tagged(self, entry: JournalEntry) -> set[tuple[str, str]]:  # noqa: ARG002
        return set()

    def referenced(self, directory: Path) -> set[str]:
        # No manifest says which set is current: whatever is there is kept, so a recovery never deletes a set.
        return set(os.listdir(directory))

    def deletable(self, name: str) -> bool:
        match = _SHARD_FILE.match(name)
        return match is not None and match["prefix"] == self.name


def is_shard_set(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a fairseq/metaseq shard set: a file named ``*-shard<r>.pt``, or a path that is no
    file or directory itself but the prefix of such files. Judged by names; :func:`shard_paths` checks more."""
    path = Path(path)
    if path.is_dir():
        return False
    if _SHARD_FILE.match(path.name):
        return True
    return not path.exists() and bool(shard_siblings(_prefix(path)))


def shard_paths(path: str | os.PathLike[str]) -> tuple[Path, list[Path]]:
    """The set's prefix and its files in rank order. Raises naming the first missing or doubled file."""
    prefix = _prefix(Path(path))
    found = shard_siblings(prefix)
    if not found:
        raise FileNotFoundError(f"{path}: no shard files {prefix.name}-shard<N>.pt in {prefix.parent}")
    doubled = next((files for files in found.values() if len(files) > 1), None)
    if doubled:
        raise ValueError(f"{doubled[1]}: names the same rank as {doubled[0]}; a shard set has one file per rank")
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise ValueError(
            f"{prefix.parent / f'{prefix.name}-shard{missing[0]}.pt'}: missing from the shard set (found shards "
            f"{sorted(found)}); a set holds one file per rank 0..N-1"
        )
    return prefix, [found[r][0] for r in range(len(found))]
