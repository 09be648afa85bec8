"""What the CLI verbs' writes of an opened input wrote, as records: :meth:`Opened.write_consolidated` and
:meth:`Opened.write_resharded` return one, and the CLI words it (:mod:`fsdp_optim.cli.verbs`). Sizes are in
bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "Consolidation",
    "FairseqCheckpoint",
    "FullDictFile",
    "RankFiles",
    "Resharding",
    "RewrittenFile",
    "ShardFiles",
    "WholeFileWritten",
]


@dataclass(frozen=True)
class FullDictFile:
    """A full dict of the optimizer state: ``params`` parameters, ``with_state`` of them with state."""

    params: int
    with_state: int
    size: int


@dataclass(frozen=True)
class WholeFileWritten:
    """A whole checkpoint as one file ``{"model", "optimizer", "extra"}``, each parameter streamed into it."""

    params: int
    param_bytes: int
    tied_names: int
    buffers: int
    optimizer_params: int | None  # parameters with optimizer state; None: saved with optim=None
    rank: int  # whose extra
    size: int


@dataclass(frozen=True)
class FairseqCheckpoint:
    """A consolidated fairseq checkpoint: its top-level ``keys``, the optimizer's full dict under ``optim_key``."""

    keys: tuple[str, ...]
    optim_key: str
    params: int
    with_state: int
    model_tensors: int | None  # None: written without the model
    size: int


@dataclass(frozen=True)
class RewrittenFile:
    """consolidate's own file of ``label`` written again, or its optimizer's full dict alone (``optimizer_only``)."""

    label: str
    optimizer_only: bool
    size: int


@dataclass(frozen=True)
class RankFiles:
    """A sharded checkpoint: its rank files, and a whole one's side files (``side_files`` None: optimizer-only)."""

    rank_files: int
    rank_bytes: int
    side_files: int | None
    side_bytes: int


@dataclass(frozen=True)
class ShardFiles:
    """A fairseq/metaseq shard set, its files' names in rank order."""

    names: tuple[str, ...]
    size: int


Consolidation: TypeAlias = FullDictFile | WholeFileWritten | FairseqCheckpoint | RewrittenFile
Resharding: TypeAlias = RankFiles | ShardFiles
