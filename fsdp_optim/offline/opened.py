"""An opened input: one small interface, one class per kind of input (:func:`fsdp_optim.offline.sources.open_source`
decides the kind once and builds the class).

Every opened input answers the same questions::

    opened.kind, opened.label       what it is, how errors name it
    opened.source                   its optimizer state as a planning Source (None: a layout file, a rank file)
    opened.layout, opened.order     the units it was saved with (None without), the parameter order
    opened.trim()                   drop file mappings touched so far
    opened.describe(path, units=)   inspect's lines
    opened.report(path, lines)      the same as one JSON object (:mod:`fsdp_optim.offline.report`)
    class_of(kind).verify_files(path, allow_globals)   ``verify``'s check of every file of an input of that kind,
                                    which may be damaged: by its names and first bytes, never opened
                                    (:mod:`fsdp_optim.offline.verdicts`)

and keeps the handle its kind has (``checkpoint``, ``manifest``, ``shards``, ``named``, ``whole_file``, ``full``,
``raw``; ``None`` for the others) for the verbs that work on that kind's own reader.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.plan import Source
from fsdp_optim.disk.file_check import Verification
from fsdp_optim.formats.fairseq import shards as fairseq_shards
from fsdp_optim.formats.kinds import Kind
from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.verification import verify_sharded
from fsdp_optim.formats.whole_file import WholeFile
from fsdp_optim.offline import describe as D
from fsdp_optim.offline import report as R
from fsdp_optim.offline import verdicts as V

__all__ = [
    "Opened",
    "OpenedCheckpoint",
    "OpenedDcp",
    "OpenedFull",
    "OpenedLayout",
    "OpenedNamed",
    "OpenedNamedDict",
    "OpenedNative",
    "OpenedRankFile",
    "OpenedShardSet",
    "OpenedWholeFile",
    "class_of",
]


@dataclass
class Opened:
    """What every opened input has (see the module docstring); a class per kind describes itself."""

    kind: Kind
    label: str
    source: Source | None = None
    layout: ModelLayout | None = None
    order: tuple[str, ...] = ()
    trim: Callable[[], None] = lambda: None
    full: Mapping[str, Any] | None = None
    manifest: Manifest | None = None
    shards: fairseq_shards.ShardSet | None = None
    checkpoint: ShardedCheckpoint | None = None
    named: NamedSafetensors | None = None
    whole_file: WholeFile | None = None
    raw: Any = None  # the loaded object of a file (a dict: the dict itself)

    def describe(self, path: Any, *, units: bool) -> list[str]:
        """``inspect``'s lines for this input (after the ``path:`` line)."""
        raise NotImplementedError(f"{type(self).__name__} does not describe itself")

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        """:meth:`describe` as one JSON object (:mod:`fsdp_optim.offline.report`); here: the members every kind has."""
        return R.base(path, self.kind, lines)

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003 - shard sets'
        """``verify``'s verdict on every file of the input of this kind at ``path`` (never opened: it may be
        damaged); here: a torch file's (a full dict, a fairscale-native dict, consolidate's whole file...)."""
        return V.torch_file(Path(path))

    def converted(self) -> Mapping[str, Any] | None:
        """The full dict this input was converted into when opened (a fairscale-native dict: consolidating it gives
        that dict); ``None`` for the others."""
        return None

    def target_layout(self, given: Any) -> Any:
        """The layout a reshard of this input cuts for: the caller's (its own for a fairscale-native dict)."""
        return given

    def is_full_dict(self) -> bool:
        """Whether this input is a full dict as it stands (a file of one, or a dict): readers may take it whole."""
        return False

    def why_not_consolidated(self) -> str:
        """Why this input (no sharded checkpoint) cannot be consolidated, in the terms of what was expected."""
        return f"{self.label}: expected an fsdp_optim manifest file, found a {self._found()}; consolidate its directory"

    def _found(self) -> str:
        keys = f" (keys {', '.join(repr(k) for k in sorted(map(str, self.raw))[:8])})" if isinstance(
            self.raw, Mapping) else ""  # fmt: skip
        return self.kind.value + keys


class OpenedCheckpoint(Opened):
    """A sharded checkpoint of ours (a whole one too: model, buffers and extra in its side files)."""

    def describe(self, path: Any, *, units: bool) -> list[str]:
        return D.describe_sharded(path, _manifest(self), self.checkpoint, layout=False, units=units)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        out = R.of_manifest(R.base(path, self.kind, lines), self.manifest)
        if self.checkpoint is not None and self.checkpoint.manifest.training is not None:
            out["model"] = R.model_of_checkpoint(self.checkpoint)
        return out

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        return verify_sharded(path)


class OpenedLayout(Opened):
    """A layout file (``save_layout``): a manifest without rank files."""

    def describe(self, path: Any, *, units: bool) -> list[str]:
        return D.describe_sharded(path, _manifest(self), None, layout=True, units=units)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_manifest(R.base(path, self.kind, lines), self.manifest)


    def why_not_consolidated(self) -> str:
        return f"{self.label}: a layout file lists no rank files: it holds no optimizer state to consolidate"

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        return V.layout_file(Path(path))


class OpenedRankFile(Opened):
    """One rank file of a sharded checkpoint (read only through its manifest; inspect says what it holds)."""

    def describe(self, path: Any, *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_rank_file(path, self.raw)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_rank_file(R.base(path, self.kind, lines), lines, self.raw)

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        return V.refuse_rank_file(Path(path))


class OpenedFull(Opened):
    """A full dict (ours, or a plain optimizer's ``state_dict()`` named)."""

    native = False

    def describe(self, path: Any, *, units: bool) -> list[str]:
        return D.describe_loaded(path, self.raw, native=self.native, units=units)

    def is_full_dict(self) -> bool:
        return not self.native

    def why_not_consolidated(self) -> str:
        return (
            f"{self.label}: expected an fsdp_optim manifest file, found a {self._found()}; it is already a full dict: "
            "nothing to consolidate (load it, or reshard it with --layout)"
        )

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_full(R.base(path, self.kind, lines), self.raw)


class OpenedNative(OpenedFull):
    """fairscale's own gathered dict (parameters numbered, not named: a layout names them)."""

    native = True

    def converted(self) -> Mapping[str, Any] | None:
        return self.full

    def target_layout(self, given: Any) -> Any:  # noqa: ARG002 - its own layout was required when it was opened
        return self.layout

    def why_not_consolidated(self) -> str:
        return Opened.why_not_consolidated(self)


class OpenedNamedDict(OpenedFull):
    """A name-keyed dict (``convert --to named``), which fsdp-optim writes and inspects only."""

    def is_full_dict(self) -> bool:  # keyed by names, not ids: not a full dict of ours
        return False

    def describe(self, path: Any, *, units: bool) -> list[str]:
        from fsdp_optim.disk.objects import check_state_dict

        check_state_dict(self.raw, str(path))
        return D.describe_named_dict(self.raw, units=units)


class OpenedDcp(Opened):
    """A PyTorch DCP directory (``convert --to dcp``), which fsdp-optim writes and inspects only."""

    def describe(self, path: Any, *, units: bool) -> list[str]:
        from fsdp_optim.formats.dcp import describe_dcp

        return describe_dcp(path, units=units)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_dcp(R.base(path, self.kind, lines), lines)

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        return V.refuse_dcp(path)


class OpenedNamed(Opened):
    """A named safetensors file (``to_safetensors``: ``<param name>/<state key>`` tensors)."""

    def describe(self, path: Any, *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_named(self.named)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_named(R.base(path, self.kind, lines), self.named)

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        return V.named_file(Path(path))


class OpenedShardSet(Opened):
    """A fairseq/metaseq shard set (``use_sharded_state`` files)."""

    def describe(self, path: Any, *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_shards(self.shards, units=units)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_manifest(R.base(path, self.kind, lines), self.manifest)

    @classmethod
    def verify_files(cls, path: Any, allow_globals: tuple[str, ...]) -> Verification:
        return V.shard_set(Path(path), allow_globals)


class OpenedWholeFile(Opened):
    """consolidate's file of a whole checkpoint (``{"model", "optimizer", "extra"}``)."""

    def describe(self, path: Any, *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_whole_file(self.whole_file)

    def report(self, path: Any, lines: Sequence[str]) -> dict[str, Any]:
        return R.of_whole_file(R.base(path, self.kind, lines), self.whole_file)


# The class of each kind of input: the one place a kind picks its class.
CLASSES: dict[Kind, type[Opened]] = {
    Kind.SHARDED: OpenedCheckpoint, Kind.LAYOUT: OpenedLayout, Kind.RANK_FILE: OpenedRankFile, Kind.FULL: OpenedFull,
    Kind.NATIVE: OpenedNative, Kind.SHARD_SET: OpenedShardSet, Kind.NAMED: OpenedNamed,
    Kind.NAMED_DICT: OpenedNamedDict, Kind.DCP: OpenedDcp, Kind.WHOLE_FILE: OpenedWholeFile,
}  # fmt: skip


def class_of(kind: Kind | None) -> type[Opened]:
    """The class of inputs of ``kind``; ``None`` (a torch file not loaded yet, whatever it holds): :class:`Opened`,
    whose class methods treat it as the torch file it is."""
    return Opened if kind is None else CLASSES[kind]


def _manifest(opened: Opened) -> Manifest:
    """The manifest a checkpoint or layout file is opened with."""
    if opened.manifest is None:
        raise ValueError(f"{opened.label}: a {opened.kind.value} opened without its manifest")
    return opened.manifest
