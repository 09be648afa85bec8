"""What every opened input answers (:class:`Opened`), with the answer of a kind that cannot; each kind's class (the
sibling modules) overrides what it can answer. See :mod:`fsdp_optim.offline.opened` for the questions."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.source import Source
from fsdp_optim.disk.one_file import write_file
from fsdp_optim.formats.kinds import Given, Kind
from fsdp_optim.formats.sharded.locate import read_manifest
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.formats.whole_file import recorded_layout
from fsdp_optim.offline import report as R
from fsdp_optim.offline.cuts import AfterFile, Progress, reshard_full
from fsdp_optim.offline.layouts import LayoutLike, ParamOrder
from fsdp_optim.offline.opened.written import Consolidation, FullDictFile, RankFiles, Resharding
from fsdp_optim.offline.whole import SideState, WholeModel, check_whole_options

if TYPE_CHECKING:
    from fsdp_optim.disk.file_check import Verification

__all__ = ["NEEDS_LAYOUT", "DcpParts", "Opened", "Request"]

NEEDS_LAYOUT = "a sharded checkpoint or layout file of the same model, wrapped the same way (see save_layout)"


@dataclass
class DcpParts:
    """What DCP export needs of an opened input: the optimizer state, and a shard set's weights and extras."""

    source: Source
    order: Sequence[str]
    trim: Callable[[], None]
    weights: Source | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    not_exported: tuple[str, ...] = ()


@dataclass(frozen=True)
class Request:
    """What :func:`~fsdp_optim.offline.sources.open_source` was asked to open, its kind decided: the input
    (``given``: a path or a dict; ``obj``: what :func:`~fsdp_optim.formats.kinds.detect` loaded of it, if anything),
    how errors name it (``label``), and the options, each already accepted for the kind."""

    kind: Kind
    given: Given
    label: str
    obj: Any = None  # loaded through the untrusted gate: a dict whose kind was decided, or None (not loaded)
    layout: ParamOrder = None
    optimizer: str | None = None
    allow_globals: Sequence[str] = ()
    optimizer_keys: Sequence[Sequence[str]] | None = None
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES

    @property
    def path(self) -> str | os.PathLike[str]:
        """``given`` as the path it is, for a kind read from its files (never a dict)."""
        if isinstance(self.given, Mapping):
            raise TypeError(f"{self.label}: a {self.kind.value} is read from files, not a dict")
        return self.given


@dataclass
class Opened:
    """What every opened input has and answers (see :mod:`fsdp_optim.offline.opened`); a class per kind."""

    kind: Kind
    label: str
    source: Source | None = None
    layout: ModelLayout | None = None
    order: tuple[str, ...] = ()
    trim: Callable[[], None] = lambda: None

    # The options a kind takes (the table of :mod:`fsdp_optim.offline.sources`): what ``layout`` means for it
    # ("target": the layout a verb that cuts it cuts for; "required": it names the parameters; "order": the model's
    # parameter order; None: refused), whether ``optimizer`` applies, whether a shard set's options
    # (``allow_globals``, ``optimizer_keys``) do; and, for a kind fsdp-optim only writes and inspects, how to load it.
    LAYOUT: ClassVar[str | None] = None
    OPTIMIZER: ClassVar[bool] = False
    SET_OPTIONS: ClassVar[bool] = False
    WRITTEN_ONLY: ClassVar[str | None] = None

    # opening (class methods: the kind is decided, nothing is open yet)

    @classmethod
    def layout_use(cls, *, target: bool) -> str | None:  # noqa: ARG003 - a shard set's answer depends on it
        """What ``layout`` means for this kind (``target``: the caller cuts it for a layout of its own)."""
        return cls.LAYOUT

    @classmethod
    def check_target_options(cls, label: str, optimizer: str | None) -> None:
        """Refuse what a verb that cuts this kind for a layout of its own cannot take (nothing by default)."""

    @classmethod
    def opening(cls, request: Request) -> AbstractContextManager[Opened]:
        """The input opened as this kind, its files mapped until the block ends; by default loaded into memory at
        once (:meth:`loaded`)."""
        return nullcontext(cls.loaded(request))

    @classmethod
    def loaded(cls, request: Request) -> Opened:
        """The input of this kind, from what :func:`~fsdp_optim.formats.kinds.detect` loaded of it."""
        raise ValueError(f"{request.label}: a {request.kind.value}, which fsdp_optim does not open")

    @classmethod
    def for_inspect(cls, request: Request) -> Opened | None:  # noqa: ARG003 - the kinds that differ override it
        """What ``inspect`` opens when opening it as usual would need what inspect is not given (a layout), or a kind
        fsdp-optim only writes; ``None``: open it as usual."""
        return None

    # inspect and verify

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        """``inspect``'s lines for this input (after the ``path:`` line)."""
        raise NotImplementedError(f"{type(self).__name__} does not describe itself")

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        """:meth:`describe` as one JSON object (:mod:`fsdp_optim.offline.report`); here: the members every kind has."""
        return R.base(path, self.kind, lines)

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003 - shard sets'
        """``verify``'s verdict on every file of the input of this kind at ``path`` (never opened: it may be
        damaged); here: a torch file's (a full dict, a fairscale-native dict, consolidate's whole file...)."""
        from fsdp_optim.offline.verdicts import torch_file  # (verify's checks: imported by it alone)

        return torch_file(Path(path))

    # what it holds

    def is_full_dict(self) -> bool:
        """Whether this input is a full dict as it stands (a file of one, or a dict): readers may take it whole."""
        return False

    def is_whole(self) -> bool:
        """Whether this input is a whole sharded checkpoint: its model's weights come from :meth:`whole_model`."""
        return False

    def holds_weights(self) -> bool:
        """Whether this input holds model weights beside the optimizer state (``--with-model`` / ``--no-model``)."""
        return False

    def whole_source(self) -> Source | None:
        """The optimizer state with the weights as one more key per parameter (``@param``); ``None`` without."""
        return None

    def whole_model(self, *, rank: int | None = None, progress: Progress = None) -> WholeModel:  # noqa: ARG002
        """A whole checkpoint's model, planned, its parameters made when asked (:mod:`fsdp_optim.offline.whole`)."""
        raise ValueError(f"{self.label}: a {self.kind.value} holds no model weights (not a whole checkpoint)")

    def side_state(self) -> SideState | None:
        """A whole checkpoint's buffers and ``extra`` per saved rank (:class:`fsdp_optim.offline.whole.SideState`)."""
        return None

    def check_rank(self, rank: int | None) -> None:
        """Refuse ``rank`` (whose side file gives the buffers and ``extra``) unless this input has such a rank."""
        check_whole_options(None, rank)

    def named_header(self) -> Mapping[str, Any] | None:
        """The ``"fsdp_optim"`` block a named safetensors file of this input keeps; ``None``: made from the source."""
        return None

    def dcp_parts(self) -> DcpParts:
        """What DCP export writes of this input (the optimizer state; a shard set's weights and extras too)."""
        if self.source is None:
            raise ValueError(f"{self.label}: a {self.kind.value} holds no optimizer state to export")
        return DcpParts(self.source, self.order, self.trim)

    # consolidate

    def why_not_consolidated(self) -> str:
        """Why this input (no sharded checkpoint) cannot be consolidated, in the terms of what was expected."""
        return f"{self.label}: expected an fsdp_optim manifest file, found a {self._found()}; consolidate its directory"

    def _found(self) -> str:
        return self.kind.value

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:  # noqa: ARG002 - the interface's
        """What consolidate gives of this input's optimizer state: the full dict (a shard set's with its extras)."""
        raise ValueError(self.why_not_consolidated())

    def full_dict(self, *, progress: Progress = None) -> Mapping[str, Any]:
        """The full dict this input is (a full dict file: itself, not copied) or gives (:meth:`full_state`)."""
        return self.full_state(progress=progress)

    def consolidated(self, *, rank: int | None, with_model: bool | None, progress: Progress) -> dict[str, Any]:
        """What :func:`fsdp_optim.consolidate` returns for this input (``rank``, ``with_model``: see there)."""
        self.check_rank(rank)
        if with_model is not None:
            raise ValueError(f"with_model: {self.label} holds no model weights (not a whole checkpoint)")
        return self.full_state(progress=progress)

    def write_consolidated(
        self, output: str | os.PathLike[str], *, rank: int | None, no_model: bool, inputs: Sequence[object],  # noqa: ARG002
        overwrite: bool,
        progress: Progress,
    ) -> Consolidation:  # fmt: skip
        """``fsdp-optim consolidate``: what consolidating this input gives, written as the file ``output``; returns
        what was written (the CLI words it)."""
        self.check_rank(rank)
        out = self.full_state(progress=progress)
        size = write_file(out, output, inputs=inputs, overwrite=overwrite)
        return FullDictFile(len(out["param_names"]), len(out["state"]), size)

    # reshard

    def target_layout(self, given: LayoutLike | None) -> LayoutLike | None:
        """The layout a reshard of this input cuts for: the caller's, else the one its ``"fsdp_optim"`` block records
        (consolidate's files: its checkpoint's FSDP layout; none: written before files recorded it)."""
        return given if given is not None else recorded_layout(self.named_header(), self.label)

    def reshard(
        self, world_size: int, out: Path, *, layout: LayoutLike | None, given: Given, progress: Progress = None,
        overwrite: bool = False, replace_existing: bool = True, after_file: AfterFile = None,
        buffers: str = "refuse",  # noqa: ARG002 - checked by the caller; none here
    ) -> Path:  # fmt: skip
        """:func:`fsdp_optim.reshard` of this input into the local directory ``out``; returns what it returns (the
        manifest). ``replace_existing=False`` (the CLI): a checkpoint already in ``out`` is refused unless
        ``overwrite``; ``after_file(path)`` as each rank file is complete; ``buffers``: see there (``world_size`` and
        ``buffers`` checked by the caller)."""
        layout = self.target_layout(layout)
        if layout is None or self.source is None:
            raise ValueError(
                f"layout: resharding a {self.kind.value} ({self.label}) needs the model's layout: {NEEDS_LAYOUT}"
            )
        return reshard_full(self.source, given, world_size, out, layout, progress, overwrite, replace_existing,
                            after_file)  # fmt: skip

    def write_resharded(
        self, world_size: int, out: Path, *, layout: LayoutLike | None, given: Given, progress: Progress,
        overwrite: bool,
        after_file: AfterFile, buffers: str,
    ) -> Resharding:  # fmt: skip
        """``fsdp-optim reshard``: :meth:`reshard` with a checkpoint already in ``out`` refused unless ``overwrite``;
        returns what was written (the CLI words it)."""
        manifest = self.reshard(world_size, out, layout=layout, given=given, progress=progress, overwrite=overwrite,
                                replace_existing=False, after_file=after_file, buffers=buffers)  # fmt: skip
        resharded = read_manifest(manifest)
        files = resharded.files
        # a whole checkpoint: weights in the rank files, side files carried
        sides = None if resharded.training is None else resharded.training.files
        return RankFiles(len(files), sum(f.nbytes for f in files), None if sides is None else len(sides),
                         sum(f.nbytes for f in sides or ()))  # fmt: skip


def found_keys(kind: Kind, raw: object) -> str:
    """``kind``, and the first keys of ``raw`` when it is a dict: what an input was found to be."""
    keys = f" (keys {', '.join(repr(k) for k in sorted(map(str, raw))[:8])})" if isinstance(raw, Mapping) else ""
    return kind.value + keys
