"""Our sharded checkpoint opened (:class:`OpenedCheckpoint`, a whole one too), and the two files of ours that are
parts of one: a layout file (:class:`OpenedLayout`) and one rank file (:class:`OpenedRankFile`)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_optim.core.flatten import StateKind
from fsdp_optim.core.source import Source
from fsdp_optim.disk.one_file import write_file
from fsdp_optim.formats.fullstate import FORMAT_KEY, FORMAT_VERSION
from fsdp_optim.formats.kinds import Given
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint, open_checkpoint
from fsdp_optim.formats.whole_file import LAYOUT_KEY, layout_record
from fsdp_optim.offline import describe as D
from fsdp_optim.offline import report as R
from fsdp_optim.offline.cuts import AfterFile, Progress, consolidate_checkpoint, reshard_checkpoint
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.opened.base import Opened, Request, found_keys
from fsdp_optim.offline.opened.written import Consolidation, FullDictFile, WholeFileWritten
from fsdp_optim.offline.whole import (
    SideState,
    WholeModel,
    check_whole_options,
    is_whole,
    whole_model,
    whole_state,
    write_whole,
)

if TYPE_CHECKING:
    from fsdp_optim.disk.file_check import Verification

__all__ = ["OpenedCheckpoint", "OpenedLayout", "OpenedRankFile"]


@dataclass(kw_only=True)
class OpenedCheckpoint(Opened):
    """A sharded checkpoint of ours (a whole one too: model, buffers and extra in its side files)."""

    checkpoint: ShardedCheckpoint

    @classmethod
    @contextmanager
    def opening(cls, request: Request) -> Iterator[Opened]:
        with open_checkpoint(request.path, lazy=False, max_mapped_bytes=request.max_mapped_bytes) as ckpt:
            manifest = ckpt.manifest
            yield cls(request.kind, request.label, ckpt.source(), manifest.layout(0), manifest.param_order, ckpt.trim,
                      checkpoint=ckpt)  # fmt: skip

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        return D.describe_sharded(path, self.checkpoint.manifest, self.checkpoint, layout=False, units=units)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        out = R.of_manifest(R.base(path, self.kind, lines), self.checkpoint.manifest)
        if self.is_whole():
            out["model"] = R.model_of_checkpoint(self.checkpoint, R.side_extras(self.checkpoint))
        return out

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        from fsdp_optim.formats.sharded.verification import verify_sharded  # (verify's checks: imported by it alone)

        return verify_sharded(path)

    def is_whole(self) -> bool:
        return is_whole(self.checkpoint)

    def holds_weights(self) -> bool:
        return self.is_whole()

    def whole_source(self) -> Source | None:
        return self.checkpoint.whole_source() if self.is_whole() else None

    def whole_model(self, *, rank: int | None = None, progress: Progress = None) -> WholeModel:
        return whole_model(self.checkpoint, rank=rank, progress=progress)

    def side_state(self) -> SideState | None:
        return SideState.of_checkpoint(self.checkpoint) if self.is_whole() else None

    def check_rank(self, rank: int | None) -> None:
        check_whole_options(self.checkpoint, rank)

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:
        if self.source is None or self.layout is None:
            raise ValueError(self.why_not_consolidated())
        return consolidate_checkpoint(self.checkpoint, self.source, self.layout, progress)

    def _optimizer(self, progress: Progress) -> dict[str, Any] | None:
        """A whole checkpoint's optimizer as a full dict, ``None`` when it was saved with ``optim=None``."""
        return None if self.checkpoint.manifest.optimizer is None else self.full_state(progress=progress)

    def consolidated(self, *, rank: int | None, with_model: bool | None, progress: Progress) -> dict[str, Any]:
        if not self.is_whole():
            return super().consolidated(rank=rank, with_model=with_model, progress=progress)
        if with_model is False:  # the optimizer's full dict alone, as for an optimizer-only checkpoint
            self.check_rank(rank)
            return self.full_state(progress=progress)
        return whole_state(self.whole_model(rank=rank, progress=progress), self._optimizer(progress))

    def write_consolidated(
        self, output: str | os.PathLike[str], *, rank: int | None, no_model: bool, inputs: Sequence[object],
        overwrite: bool,
        progress: Progress,
    ) -> Consolidation:  # fmt: skip
        if not self.is_whole() or no_model:  # the optimizer's full dict, its layout recorded
            self.check_rank(rank)
            out = self._with_layout(self.full_state(progress=progress))
            size = write_file(out, output, inputs=inputs, overwrite=overwrite)
            return FullDictFile(len(out["param_names"]), len(out["state"]), size)
        # A whole checkpoint -> one file {"model", "optimizer", "extra"}, each parameter streamed.
        whole = self.whole_model(rank=rank, progress=progress)
        optimizer = self._optimizer(progress)
        optimizer = None if optimizer is None else self._with_layout(optimizer)
        size = write_whole(whole, optimizer, output, inputs=inputs, overwrite=overwrite)
        optimizer_params = None if optimizer is None else len(optimizer["state"])
        return WholeFileWritten(len(whole.params), whole.param_bytes(), len(whole.aliases), len(whole.buffers),
                                optimizer_params, whole.rank, size)  # fmt: skip

    def _with_layout(self, full: dict[str, Any]) -> dict[str, Any]:
        """``full`` (this checkpoint's consolidated full dict) with its FSDP layout recorded in its ``"fsdp_optim"``
        block, so that a reshard of the file written from it needs no ``--layout``."""
        if self.layout is None:
            return full
        return {**full, FORMAT_KEY: {**full[FORMAT_KEY], LAYOUT_KEY: layout_record(self.layout)}}

    def named_header(self) -> Mapping[str, Any] | None:
        """The ``"fsdp_optim"`` block a named safetensors file of this checkpoint keeps (as the writer makes it from
        the source), its layout recorded too."""
        if self.source is None or self.layout is None:
            return None
        scalars = {e.key for flat in self.source.flats for e in flat.state if e.kind is StateKind.SCALAR}
        return {"version": FORMAT_VERSION, "optimizer": self.source.optimizer, "world_size": self.source.world_size,
                "scalar_keys": sorted(scalars), LAYOUT_KEY: layout_record(self.layout)}  # fmt: skip

    def reshard(
        self, world_size: int, out: Path, *, layout: LayoutLike | None, given: Given, progress: Progress = None,  # noqa: ARG002
        overwrite: bool = False, replace_existing: bool = True, after_file: AfterFile = None, buffers: str = "refuse",
    ) -> Path:  # fmt: skip
        if self.source is None:
            raise ValueError(f"{self.label}: expected a sharded checkpoint, found a {self.kind.value}")
        return reshard_checkpoint(self.checkpoint, self.source, given, world_size, out, progress, overwrite,
                                  replace_existing, after_file, buffers)  # fmt: skip


@dataclass(kw_only=True)
class OpenedLayout(Opened):
    """A layout file (``save_layout``): a manifest without rank files."""

    manifest: Manifest

    @classmethod
    def loaded(cls, request: Request) -> Opened:
        return cls(request.kind, request.label, manifest=read_manifest(request.path))

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        return D.describe_sharded(path, self.manifest, None, layout=True, units=units)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_manifest(R.base(path, self.kind, lines), self.manifest)

    def why_not_consolidated(self) -> str:
        return f"{self.label}: a layout file lists no rank files: it holds no optimizer state to consolidate"

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        from fsdp_optim.offline.verdicts import layout_file

        return layout_file(Path(path))


@dataclass(kw_only=True)
class OpenedRankFile(Opened):
    """One rank file of a sharded checkpoint (read only through its manifest; inspect says what it holds)."""

    raw: Mapping[str, Any] | None  # the file's loaded dict (a format-1 torch file; None: a safetensors file)

    @classmethod
    def loaded(cls, request: Request) -> Opened:
        return cls(request.kind, request.label, raw=request.obj)

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_any_rank_file(path, self.raw)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_rank_file(R.base(path, self.kind, lines), lines, self.raw)

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        raise ValueError(
            f"{path}: a rank file of a sharded checkpoint is checked against its manifest; verify the checkpoint "
            f"directory ({Path(path).parent}) instead"
        )

    def _found(self) -> str:
        return found_keys(self.kind, self.raw)
