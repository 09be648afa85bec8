"""The Hugging Face layout that ``convert --to safetensors`` writes of a whole checkpoint, opened
(:class:`OpenedHf`): ``model.safetensors`` (or its shards and index) and, beside them, ``optimizer.safetensors`` (a
named file of ours); or one model file alone. Read whole into memory and answered as consolidate's file of a whole
checkpoint is (:class:`~fsdp_optim.offline.opened.loaded.OpenedWholeFile`): its weights, tied names, buffers and
optimizer state; it holds no ``extra``.

The model files record no checksums: ``verify`` checks their headers and that every byte reads, and every checksum
of ``optimizer.safetensors``. A tied name is a copy of its parameter's tensor in these files: with the optimizer's
parameter names it is told apart by its bytes (as a consolidated file without its list of tied names is).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_optim.disk.file_check import Verification, check_file
from fsdp_optim.formats import hf_safetensors as hf
from fsdp_optim.formats.kinds import Kind
from fsdp_optim.formats.named_safetensors.document import METADATA_KEY, FormatError
from fsdp_optim.formats.named_safetensors.reader import NamedSafetensors, tie_copies
from fsdp_optim.formats.whole_file import WholeFile
from fsdp_optim.offline import describe as D
from fsdp_optim.offline import verdicts as V
from fsdp_optim.offline.cuts import Progress
from fsdp_optim.offline.opened.base import Request
from fsdp_optim.offline.opened.loaded import OpenedWholeFile
from fsdp_optim.offline.side_state import SideState

__all__ = ["OpenedHf"]


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
