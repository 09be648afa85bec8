"""``fsdp-optim consolidate SRC -o FILE.safetensors``: a checkpoint as ONE safetensors file, laid out before a byte
is written (:func:`lay_out`), so that one process or many, into a local file or an upload, write the same bytes.

The file is a named safetensors file (:mod:`fsdp_optim.formats.named_safetensors.document`): the optimizer state as
``<param name>/<state key>`` tensors and its settings in the ``"fsdp_optim"`` metadata; a whole checkpoint adds the
model (the unwrapped ``state_dict()``: weights, tied names as copies, buffers) under its own names, listed with the
chosen rank's ``extra`` in the document's ``"whole"`` section (version 3). ``extra`` is kept as a whole checkpoint's
side file keeps it: JSON (exact: tuples, non-finite floats tagged) with each tensor (an RNG state) a reference to a
tensor ``extra/<k>`` of the file; anything else (an object) is refused before the output is touched::

    plan     every tensor's name, dtype, shape (model first, in state_dict order; then the optimizer's, in parameter
             then state order) -> offsets; the header with checksums of fixed width left as zeros -> its length
    write    the file laid out (ftruncate); each tensor made, hashed, written with os.pwrite at its offset, freed
             (one tensor in memory)
    header   the same header with the checksums filled in (exactly as long), written at offset 0; fsync; rename
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fsdp_optim.disk.text import human_bytes
from fsdp_optim.formats.named_safetensors.document import METADATA_KEY, Document, Whole
from fsdp_optim.formats.named_safetensors.writer import prepare_named_safetensors, tensor_checksums
from fsdp_optim.formats.safetensors_container import Tensor, check_portable, data_bytes, encode_header
from fsdp_optim.formats.sharded.side_file import encode_extra

if TYPE_CHECKING:
    from fsdp_optim.job.team import Team, Watch

__all__ = ["EXTRA_PREFIX", "FileLayout", "described", "final_header", "lay_out", "made", "stepped"]

EXTRA_PREFIX = "extra/"  # a whole checkpoint's extra's tensors: extra/0, extra/1, ... (as its side file names them)


@dataclass(frozen=True)
class FileLayout:
    """The file before any byte of it: its tensors in file order, the document, where each tensor's bytes start."""

    document: Document
    tensors: tuple[Tensor, ...]
    offsets: tuple[int, ...]  # absolute, in the file
    size: int

    def header(self, sums: Mapping[str, Any] | None) -> bytes:
        """The header (length prefix included); ``sums`` ``None``: the placeholders, of the same length."""
        if sums is None:
            sums = {t.name: tensor_checksums(None, t.nbytes) for t in self.tensors}
        metadata = {"format": "pt", METADATA_KEY: self.document.to_json(sums)}
        return encode_header(metadata, ((t.name, t.dtype, t.shape) for t in self.tensors))


def lay_out(opened: Any, *, rank: int | None, no_model: bool) -> FileLayout:
    """The :class:`FileLayout` of ``opened`` (an :func:`~fsdp_optim.offline.sources.open_source` input holding
    optimizer state; a whole checkpoint's model too unless ``no_model``; ``rank``: whose side file gives the buffers
    and ``extra``). Everything is checked here, before any output exists: no optimizer state, a dtype safetensors
    cannot name, an ``extra`` or hyperparameter that exact JSON cannot hold, two tensors of one name."""
    opened.check_rank(rank)
    if opened.source is None:
        raise ValueError(f"{opened.label}: a {opened.kind.value} holds no optimizer state (saved with optim=None?); "
                         "consolidate it to a .pt file, or convert --to safetensors for the model alone")  # fmt: skip
    prepared = prepare_named_safetensors(opened.source, order=opened.order, header=opened.named_header())
    tensors = list(prepared.tensors)
    whole = None
    if opened.is_whole() and not no_model:
        saved = opened.whole_model(rank=rank)
        entries = saved.entries(lambda p: p)
        weights = [_model_tensor(name, t) for name, t in entries.items()]
        text, held = encode_extra(saved.extra, f"{opened.label}: the checkpoint's extra (rank {saved.rank}'s)")
        extras = [_model_tensor(f"{EXTRA_PREFIX}{k}", t) for k, t in held.items()]
        whole = Whole(tuple(entries), text, tuple(t.name for t in extras), saved.rank, tuple(saved.aliases))
        tensors = [*weights, *extras, *tensors]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{opened.label}: two tensors would both be named '{twice}' in one safetensors file")
    layout = FileLayout(replace(prepared.document, whole=whole), tuple(tensors), (), 0)
    at = len(layout.header(None))
    offsets = []
    for t in tensors:
        offsets.append(at)
        at += t.nbytes
    return replace(layout, offsets=tuple(offsets), size=at)


def _model_tensor(name: str, t: Any) -> Tensor:
    make = t.make if isinstance(t, Tensor) else lambda: t  # else a buffer, in memory already
    return Tensor(name, tuple(t.shape), check_portable(name, t.dtype), make)


def final_header(layout: FileLayout, shares: Sequence[Mapping[str, Any]]) -> bytes:
    """The final header: every tensor's checksum from the shares (each ``{name: checksum}``), as long as the room
    the layout planned for it (``RuntimeError`` for a tensor no process wrote)."""
    sums = {name: s for share in shares for name, s in share.items()}
    missing = [t.name for t in layout.tensors if t.name not in sums]
    if missing:
        raise RuntimeError(f"consolidate: no process wrote tensors {missing[:3]} ({len(missing)} in all)")
    header = layout.header(sums)
    if len(header) != (layout.offsets[0] if layout.offsets else layout.size):
        raise RuntimeError("consolidate: the header with its checksums is not as long as the one planned")
    return header


def made(t: Tensor, sums: dict[str, Any]) -> memoryview:
    """Tensor ``t`` made (``ValueError`` unless as planned) and its checksums put in ``sums``: its bytes."""
    tensor = t.made()
    sums[t.name] = tensor_checksums(tensor, t.nbytes)
    return data_bytes(tensor)


def stepped(team: Team | None, what: str, *, watch: Watch | None = None) -> AbstractContextManager[None]:
    """``team.step(what, watch=watch)``; nothing to agree on for a process alone."""
    return nullcontext() if team is None else team.step(what, watch=watch)


def described(layout: FileLayout, size: int) -> str:
    """The report of a written file: how many tensors of the model and of the optimizer, and its size."""
    whole = layout.document.whole
    model = 0 if whole is None else len(whole.model)
    optim = len(layout.tensors) - model - (0 if whole is None else len(whole.extra_tensors))
    what = f"model {model} tensors (weights, tied names, buffers), extra of rank {whole.rank}; " if whole else ""
    return (f"safetensors, one file: {what}optimizer {optim} tensors of {len(layout.document.state)} params with "
            f"state, settings in its metadata; {human_bytes(size)}")  # fmt: skip
