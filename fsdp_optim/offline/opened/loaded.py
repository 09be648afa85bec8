"""Inputs loaded as one object: a full dict (:class:`OpenedFull`), fairscale's own gathered dict
(:class:`OpenedNative`), a name-keyed dict (:class:`OpenedNamedDict`) and consolidate's file of a whole checkpoint
(:class:`OpenedWholeFile`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

from fsdp_optim.core.elementwise import check_optimizer_name
from fsdp_optim.core.flatten import clone_value
from fsdp_optim.core.preconditions import check_full_dict
from fsdp_optim.core.source import Source
from fsdp_optim.disk.objects import check_state_dict
from fsdp_optim.disk.one_file import write_file
from fsdp_optim.formats.fairscale import from_fairscale
from fsdp_optim.formats.fullstate import full_dict_source, read_meta
from fsdp_optim.formats.kinds import Given
from fsdp_optim.formats.whole_file import WholeFile
from fsdp_optim.offline import describe as D
from fsdp_optim.offline import report as R
from fsdp_optim.offline.cuts import AfterFile, Progress, reshard_full
from fsdp_optim.offline.layouts import LayoutLike, resolve_layout
from fsdp_optim.offline.opened.base import Opened, Request, found_keys
from fsdp_optim.offline.opened.written import Consolidation, RewrittenFile
from fsdp_optim.offline.whole import SideState, WholeModel, whole_model_of

__all__ = ["OpenedFull", "OpenedNamedDict", "OpenedNative", "OpenedWholeFile"]


def _header(full: Mapping[str, Any] | None, label: str) -> Mapping[str, Any] | None:
    """The ``"fsdp_optim"`` block of the full dict ``full``, if it has one."""
    meta = None if full is None else read_meta(full, label)
    return dict(meta) if meta is not None else None


@dataclass(kw_only=True)
class OpenedFull(Opened):
    """A full dict (ours, or a plain optimizer's ``state_dict()`` named)."""

    raw: Mapping[str, Any]  # the loaded dict (a dict given: the dict itself)
    full: Mapping[str, Any] | None = None  # the full dict it is (a fairscale-native dict: converted into)

    native = False
    LAYOUT: ClassVar[str | None] = "target"

    @classmethod
    def loaded(cls, request: Request) -> Opened:
        obj, label = request.obj, request.label
        check_full_dict(obj, label)
        if not isinstance(request.given, Mapping):
            check_state_dict(obj, label)
        source = full_dict_source(obj, label=label)
        order = tuple(f.params[0].name for f in source.flats)
        return cls(request.kind, label, source, None, order, full=obj, raw=obj)

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        return D.describe_loaded(path, self.raw, native=self.native, units=units)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_full(R.base(path, self.kind, lines), self.raw)

    def is_full_dict(self) -> bool:
        return not self.native

    def _found(self) -> str:
        return found_keys(self.kind, self.raw)

    def why_not_consolidated(self) -> str:
        return (
            f"{self.label}: expected an fsdp_optim manifest file, found a {self._found()}; it is already a full dict: "
            "nothing to consolidate (load it, or reshard it with --layout)"
        )

    def full_dict(self, *, progress: Progress = None) -> Mapping[str, Any]:
        if self.is_full_dict() and self.full is not None:
            return self.full
        return super().full_dict(progress=progress)

    def named_header(self) -> Mapping[str, Any] | None:
        return _header(self.full, self.label)


@dataclass(kw_only=True)
class OpenedNative(OpenedFull):
    """fairscale's own gathered dict (parameters numbered, not named: a layout names them; ``full``: the full dict
    it was converted into, ``None`` when inspect opened it without a layout)."""

    native = True
    LAYOUT = "required"
    OPTIMIZER = True

    @classmethod
    def loaded(cls, request: Request) -> Opened:
        obj, label = request.obj, request.label
        model = resolve_layout(cast(LayoutLike, request.layout))  # required (checked); anything else: its TypeError
        state = obj.get("state")
        keys = {str(k) for entries in state.values() if isinstance(entries, Mapping) for k in entries} if isinstance(
            state, Mapping) else set()  # fmt: skip
        check_optimizer_name(request.optimizer, keys, where=f"optimizer: {label}")
        full = from_fairscale(obj, model, optimizer=request.optimizer)
        source = full_dict_source(full, label=label)
        return cls(request.kind, label, source, model, model.param_order, full=full, raw=obj)

    @classmethod
    def for_inspect(cls, request: Request) -> Opened | None:
        return cls(request.kind, request.label, raw=request.obj) if request.layout is None else None  # as it is

    def target_layout(self, given: LayoutLike | None) -> LayoutLike | None:  # noqa: ARG002 - its own layout was required when it was opened
        return self.layout

    def why_not_consolidated(self) -> str:
        return Opened.why_not_consolidated(self)

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:  # noqa: ARG002 - the interface's
        if self.full is None:
            raise ValueError(self.why_not_consolidated())
        return dict(self.full)  # the full dict it was converted into


@dataclass(kw_only=True)
class OpenedNamedDict(OpenedFull):
    """A name-keyed dict (``convert --to named``), which fsdp-optim writes and inspects only."""

    LAYOUT = None
    WRITTEN_ONLY = (
        "load it with torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, or convert the source it was "
        "made from"
    )

    @classmethod
    def for_inspect(cls, request: Request) -> Opened | None:
        return cls(request.kind, request.label, raw=request.obj)

    def is_full_dict(self) -> bool:  # keyed by names, not ids: not a full dict of ours
        return False

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        return D.describe_loaded(path, self.raw, units=units, named=True)


@dataclass(kw_only=True)
class OpenedWholeFile(Opened):
    """consolidate's file of a whole checkpoint (``{"model", "optimizer", "extra"}``)."""

    whole_file: WholeFile
    saved_rank: int = 0  # whose extra the file kept (consolidate's .pt does not say: rank 0's by default)

    LAYOUT = "target"

    @classmethod
    def loaded(cls, request: Request) -> Opened:
        label = request.label
        whole = WholeFile.of(request.obj, label)
        if whole.optimizer is not None:
            check_full_dict(whole.optimizer, f"{label}['optimizer']")
            check_state_dict(whole.optimizer, f"{label}['optimizer']", in_memory=isinstance(request.given, Mapping))
        return cls(request.kind, label, whole.source(), None, whole.params, whole_file=whole)

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_whole_file(self.whole_file)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_whole_file(R.base(path, self.kind, lines), self.whole_file)

    def holds_weights(self) -> bool:
        return True

    def is_whole(self) -> bool:
        return True

    def whole_model(self, *, rank: int | None = None, progress: Progress = None) -> WholeModel:  # noqa: ARG002
        self.check_rank(rank)
        return whole_model_of(self.whole_file, rank=self.saved_rank)

    def whole_source(self) -> Source | None:
        return self.whole_file.whole_source()

    def side_state(self) -> SideState | None:
        return SideState.of_whole_file(self.whole_file)

    def check_rank(self, rank: int | None) -> None:
        if rank is not None:
            raise ValueError(f"rank: {self.label} holds one rank's extra (a consolidated file): no rank to choose")

    def named_header(self) -> Mapping[str, Any] | None:
        return _header(self.whole_file.optimizer, self.label)

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:  # noqa: ARG002 - the interface's
        return self.consolidated(rank=None, with_model=False, progress=None)

    def consolidated(self, *, rank: int | None, with_model: bool | None, progress: Progress) -> dict[str, Any]:  # noqa: ARG002
        """The file's content (each tensor new memory; tied names one tensor), or with ``with_model=False`` its
        optimizer's full dict."""
        self.check_rank(rank)
        whole = self.whole_file
        if with_model is False:
            if whole.optimizer is None:
                raise ValueError(f"with_model: {self.label} was saved without an optimizer: the model is all it holds")
            return dict(clone_value(whole.optimizer))
        # One deep copy of the three: a tied parameter stays one tensor under both names.
        return dict(clone_value({"model": dict(whole.model), "optimizer": whole.optimizer, "extra": whole.extra}))

    def write_consolidated(
        self, output: str | os.PathLike[str], *, rank: int | None, no_model: bool, inputs: Sequence[object],
        overwrite: bool,  # noqa: ARG002
        progress: Progress,
    ) -> Consolidation:  # fmt: skip
        """consolidate's own output, written again (or its optimizer alone)."""
        out = self.consolidated(rank=rank, with_model=False if no_model else None, progress=progress)
        size = write_file(out, output, inputs=inputs)
        return RewrittenFile(self.label, no_model, size)

    def reshard(
        self, world_size: int, out: Path, *, layout: LayoutLike | None, given: Given, progress: Progress = None,
        overwrite: bool = False, replace_existing: bool = True, after_file: AfterFile = None,
        buffers: str = "refuse",  # noqa: ARG002 - checked by the caller; a whole file's buffers are shared
    ) -> Path:  # fmt: skip
        layout = self.target_layout(layout)
        if layout is None:  # refused there: the file names no units and records none
            return super().reshard(world_size, out, layout=layout, given=given)
        # weights, optimizer, buffers and extra: a whole one
        return reshard_full(self.whole_file, given, world_size, out, layout, progress, overwrite, replace_existing,
                            after_file)  # fmt: skip
