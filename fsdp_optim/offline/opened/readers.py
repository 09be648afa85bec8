"""Inputs read through a reader of their own: a fairseq/metaseq shard set (:class:`OpenedShardSet`), a named
safetensors file (:class:`OpenedNamed`), a PyTorch DCP directory (:class:`OpenedDcp`) and the Hugging Face layout
(:class:`OpenedHf`).

:class:`OpenedHf`: the layout ``convert --to safetensors`` writes of a whole checkpoint, ``model.safetensors`` (or
its shards and index) and, beside them, ``optimizer.safetensors`` (a named file of ours); or one model file alone.
Read whole into memory and answered as consolidate's file of a whole checkpoint is
(:class:`~fsdp_optim.offline.opened.loaded.OpenedWholeFile`); it holds no ``extra``. The model files record no
checksums: ``verify`` checks their headers and that every byte reads, and every checksum of
``optimizer.safetensors``. A tied name is a copy of its parameter's tensor in these files: with the optimizer's
parameter names it is told apart by its bytes (as a consolidated file without its list of tied names is).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fsdp_optim.core.elementwise import check_optimizer_name
from fsdp_optim.core.flatten import clone_value
from fsdp_optim.disk.file_check import Verification, check_file
from fsdp_optim.disk.one_file import write_file
from fsdp_optim.formats import hf_safetensors as hf
from fsdp_optim.formats.fairseq.files import OPTIM_KEY
from fsdp_optim.formats.fairseq.recut import consolidate_set, reshard_set
from fsdp_optim.formats.fairseq.shards import ShardSetReader
from fsdp_optim.formats.kinds import Given, Kind
from fsdp_optim.formats.named_safetensors.document import METADATA_KEY, FormatError
from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors, tie_copies
from fsdp_optim.formats.whole_file import WholeFile
from fsdp_optim.offline import describe as D
from fsdp_optim.offline import fairseq as F
from fsdp_optim.offline import report as R
from fsdp_optim.offline import verdicts as V
from fsdp_optim.offline.cuts import AfterFile, Progress
from fsdp_optim.offline.layouts import LayoutLike
from fsdp_optim.offline.opened.base import DcpParts, Opened, Request
from fsdp_optim.offline.opened.loaded import OpenedWholeFile
from fsdp_optim.offline.opened.written import Consolidation, FairseqCheckpoint, Resharding, ShardFiles
from fsdp_optim.offline.whole import SideState

__all__ = ["OpenedDcp", "OpenedHf", "OpenedNamed", "OpenedNamedWhole", "OpenedShardSet"]


@dataclass(kw_only=True)
class OpenedShardSet(Opened):
    """A fairseq/metaseq shard set (``use_sharded_state`` files): consolidated into a fairseq checkpoint and
    resharded as a shard set, in its own format (:mod:`fsdp_optim.formats.fairseq.recut`)."""

    shards: ShardSetReader

    LAYOUT = "order"
    OPTIMIZER = True
    SET_OPTIONS = True

    @classmethod
    def layout_use(cls, *, target: bool) -> str | None:
        return None if target else cls.LAYOUT  # resharding a set keeps its own ids, order and optimizer

    @classmethod
    def check_target_options(cls, label: str, optimizer: str | None) -> None:
        if optimizer is not None:
            raise ValueError(f"optimizer: {label} is a {Kind.SHARD_SET.value}; resharding it keeps the optimizer its "
                             "files hold")  # fmt: skip

    @classmethod
    @contextmanager
    def opening(cls, request: Request) -> Iterator[Opened]:
        with F.ShardSet(  # (its layout option resolved into parameter names)
            request.path,
            param_order=request.layout,
            optimizer=request.optimizer,
            optimizer_keys=request.optimizer_keys,
            allow_globals=request.allow_globals,
            max_mapped_bytes=request.max_mapped_bytes,
        ) as shards:
            source = shards.source()
            keys = {e.key for flat in source.flats for e in flat.state}
            check_optimizer_name(request.optimizer, keys, where=f"optimizer: {request.label}")
            yield cls(request.kind, request.label, source, shards.manifest.layout(0), shards.manifest.param_order,
                      shards.trim, shards=shards)  # fmt: skip

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_shards(self.shards, units=units)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_manifest(R.base(path, self.kind, lines), self.shards.manifest)

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:
        return V.shard_set(Path(path), allow_globals)

    def holds_weights(self) -> bool:
        return True

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:
        return consolidate_set(self.shards, with_model=False, progress=progress)[OPTIM_KEY]

    def write_consolidated(
        self, output: str | os.PathLike[str], *, rank: int | None, no_model: bool, inputs: Sequence[object],
        overwrite: bool,
        progress: Progress,
    ) -> Consolidation:  # fmt: skip
        """The whole consolidated fairseq checkpoint (every key; the weights unless ``no_model``)."""
        self.check_rank(rank)
        out = consolidate_set(self.shards, with_model=not no_model, progress=progress)
        size = write_file(out, output, inputs=inputs, overwrite=overwrite)
        full = out[OPTIM_KEY]
        model = len(out["model"]) if "model" in out else None
        return FairseqCheckpoint(tuple(out), OPTIM_KEY, len(full["param_names"]), len(full["state"]), model, size)

    def reshard(
        self, world_size: int, out: Path, *, layout: LayoutLike | None, given: Given, progress: Progress = None,  # noqa: ARG002
        overwrite: bool = False, replace_existing: bool = True, after_file: AfterFile = None, buffers: str = "refuse",  # noqa: ARG002
    ) -> Path:  # fmt: skip
        """A shard set for ``world_size`` ranks in ``out`` (returned), its own ids, order and optimizer kept."""
        reshard_set(self.shards, world_size, out, overwrite=overwrite, progress=progress)
        return out

    def write_resharded(
        self, world_size: int, out: Path, *, layout: LayoutLike | None, given: Given, progress: Progress,  # noqa: ARG002
        overwrite: bool,
        after_file: AfterFile, buffers: str,  # noqa: ARG002
    ) -> Resharding:  # fmt: skip
        written = reshard_set(self.shards, world_size, out, overwrite=overwrite, progress=progress)
        return ShardFiles(tuple(f.name for f in written), sum(f.stat().st_size for f in written))

    def dcp_parts(self) -> DcpParts:
        shards, parts = self.shards, super().dcp_parts()
        rank0 = shards.rank0()
        aliases = {**shards.aliases, **{alias: shards.full_name(key) for alias, key in shards.model_aliases.items()}}
        parts.weights, parts.aliases = shards.weights_source(), aliases
        parts.buffers = {name: rank0["model"][name].clone() for name in shards.buffers}
        parts.extras = {key: clone_value(rank0[OPTIM_KEY][key]) for key in shards.extras}
        parts.not_exported = tuple(k for k in rank0 if k not in ("model", OPTIM_KEY))
        return parts


@dataclass(kw_only=True)
class OpenedNamed(Opened):
    """A named safetensors file (``to_safetensors``: ``<param name>/<state key>`` tensors)."""

    named: NamedSafetensors

    LAYOUT = "target"

    @classmethod
    @contextmanager
    def opening(cls, request: Request) -> Iterator[Opened]:
        with NamedSafetensors(request.path, max_mapped_bytes=request.max_mapped_bytes) as named:
            content = named.whole_dict()
            if content is not None:  # consolidate's one file of a whole checkpoint: read whole, as its .pt twin is
                whole = WholeFile.of(content, request.label)
                rank = named.document.whole.rank  # type: ignore[union-attr]
                yield OpenedNamedWhole(request.kind, request.label, whole.source(), None, whole.params,
                                       whole_file=whole, saved_rank=rank)  # fmt: skip
                return
            yield cls(request.kind, request.label, named.source(), None, named.document.param_order, named.trim,
                      named=named)  # fmt: skip

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:  # noqa: ARG002 - the interface's arguments
        return D.describe_named(self.named)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_named(R.base(path, self.kind, lines), self.named)

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        return V.named_file(Path(path))

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:  # noqa: ARG002 - the interface's
        return self.named.full_state()  # the dict it was written from

    def named_header(self) -> Mapping[str, Any] | None:
        return self.named.document.header


@dataclass(kw_only=True)
class OpenedNamedWhole(OpenedWholeFile):
    """consolidate's one safetensors file of a whole checkpoint (its document's ``"whole"`` section): the weights,
    tied names, buffers, optimizer state and ``extra`` read into memory and answered as consolidate's ``.pt`` file of
    it is (:class:`~fsdp_optim.offline.opened.loaded.OpenedWholeFile`); ``verify`` checks its every checksum, as
    any named file's (:meth:`OpenedNamed.verify_files`: its kind's class)."""

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        lines = super().describe(path, units=units)
        return [f"format: {Kind.NAMED.value}, a whole checkpoint's (extra of saved rank {self.saved_rank})",
                *lines[1:]]  # fmt: skip


class OpenedDcp(Opened):
    """A PyTorch DCP directory (``convert --to dcp``), which fsdp-optim writes and inspects only."""

    WRITTEN_ONLY = "load it with torch.distributed.checkpoint.load, or convert the source it was made from"

    @classmethod
    def for_inspect(cls, request: Request) -> Opened | None:
        return cls(request.kind, request.label)  # a directory: no object loaded

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:
        from fsdp_optim.formats.dcp import describe_dcp

        return describe_dcp(path, units=units)

    def report(self, path: str | os.PathLike[str], lines: Sequence[str]) -> dict[str, Any]:
        return R.of_dcp(R.base(path, self.kind, lines), lines)

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        raise ValueError(  # it records no checksums: refused, naming what reads it
            f"{path}: a {Kind.DCP.value}, which records no checksums to verify; fsdp-optim inspect {path} reads its "
            "metadata, and torch.distributed.checkpoint.load reads its data"
        )


class OpenedHf(OpenedWholeFile):
    """A Hugging Face safetensors model (a directory of this layout, or one model file); see the module docstring."""

    @classmethod
    def loaded(cls, request: Request) -> OpenedHf:
        path = Path(request.path)
        optimizer = None
        if path.is_dir() and (path / hf.OPTIMIZER).is_file():
            with NamedSafetensors(path / hf.OPTIMIZER) as named:
                optimizer = named.full_state()
        model = hf.read_model(path)
        if optimizer is not None:
            model = tie_copies(model, set(optimizer["param_names"].values()))
        whole = WholeFile.of({"model": model, "optimizer": optimizer, "extra": None}, request.label)
        return cls(request.kind, request.label, whole.source(), None, whole.params, whole_file=whole)

    def describe(self, path: str | os.PathLike[str], *, units: bool) -> list[str]:  # noqa: ARG002
        files = [f.name for f in hf.model_files(path)]
        beside = Path(path).is_dir() and (Path(path) / hf.OPTIMIZER).is_file()
        lines = D.describe_whole_file(self.whole_file)[1:]
        return [
            f"format: {Kind.HF.value}",
            f"files: {', '.join(files)}" + (f", {hf.OPTIMIZER}" if beside else " (no optimizer state beside them)"),
            *(line for line in lines if not line.startswith("extra:")),
            "extra: none (this layout holds the model and the optimizer state only)",
        ]

    def full_state(self, *, progress: Progress = None) -> dict[str, Any]:
        if self.whole_file.optimizer is None:  # what a reader of optimizer state (load_full_state...) was handed
            raise FormatError(
                f"{self.label}: a safetensors file without fsdp_optim's '{METADATA_KEY}' metadata: a model's weights "
                f"({Kind.HF.value}) and no optimizer state (no {hf.OPTIMIZER} beside them)"
            )
        return super().full_state(progress=progress)

    def side_state(self) -> SideState | None:
        return replace(SideState.of_whole_file(self.whole_file), holds_extra=False)  # no extra: not an extra of None

    @classmethod
    def verify_files(cls, path: str | os.PathLike[str], allow_globals: tuple[str, ...]) -> Verification:  # noqa: ARG003
        """Each model file's header and every byte of it read (no checksums recorded), and ``optimizer.safetensors``
        beside them as a named file (every checksum)."""
        root = Path(path)
        try:
            files = hf.model_files(root)
        except ValueError as exc:
            return Verification(root, Kind.HF.value, (), (str(exc),))
        checks = [check_file(f, _read_model_file, zipped=False) for f in files]
        if root.is_dir() and (root / hf.OPTIMIZER).exists():
            checks += V.named_file(root / hf.OPTIMIZER).files
        return Verification(root, Kind.HF.value, tuple(checks))


def _read_model_file(path: Any) -> str:
    count = len(hf.read_model(path))
    return f", {count} tensors read (the layout records no checksums: header and sizes checked)"
