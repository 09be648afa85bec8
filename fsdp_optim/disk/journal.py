"""One journal entry of an output's lock (:mod:`fsdp_optim.disk.locks`): what a writer is about to create, typed.

On disk an entry is one line ``{"journal": {...}}`` of the lock file, its members those given, in this order::

    {"save_id": "3f2a9c1b0d4e...", "world_size": 2,         # a checkpoint's files (formats/sharded/writer.py)
     "files": ["model-00001-of-00002.safetensors", ...],     # names a write creates (a model directory)
     "file": "out.pt", "tag": "9d0c...",                     # one output file and its temporary file's tag
     "staging": ".out.fsdp-optim-staging-...",              # the staging directory of a directory output
     "replaces": ["optim-...-rank00000-of-00002.safetensors"],  # what the commit makes obsolete
     "moved": ["optim-...", "manifest.json"]}                # what was moved in (a kill from here on is undone)

A journal is a file, so what is read back is untrusted: a member of the wrong type reads as absent (``None``), and
each format checks the values it uses (:class:`fsdp_optim.disk.save.Claims`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["JournalEntry"]


@dataclass(frozen=True)
class JournalEntry:
    """One journal entry (see the module docstring); ``None``: not announced."""

    save_id: str | None = None
    world_size: int | None = None
    files: tuple[str, ...] | None = None
    file: str | None = None
    tag: str | None = None
    staging: str | None = None
    replaces: tuple[str, ...] | None = None
    moved: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON object: the members announced, names as lists."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JournalEntry:
        """An entry read back from a lock file: members of the wrong type (or unknown ones) read as absent."""
        text = {k: d[k] if isinstance(d.get(k), str) else None for k in ("save_id", "file", "tag", "staging")}
        size = d.get("world_size")
        return cls(
            world_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
            files=_names(d.get("files")),
            replaces=_names(d.get("replaces")),
            moved=_names(d.get("moved")),
            **text,
        )


def _names(value: Any) -> tuple[str, ...] | None:
    """A list of names as read back: its strings (anything else in it dropped); ``None`` for no list."""
    return tuple(n for n in value if isinstance(n, str)) if isinstance(value, list) else None
