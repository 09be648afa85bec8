"""The metadata of a named safetensors optimizer file: exact JSON values, the document, the checked file header.

Pure apart from reading a file's first bytes in :func:`read_named_header`; never imports ``torch.distributed``.

A file is a plain safetensors file (8-byte little-endian header length, a JSON header, the data) whose tensors
are named ``<parameter name>/<state key>`` (``layer1.weight/exp_avg``: full, unsharded, shaped like the
parameter; ``layer1.weight/step``: a 0-dim tensor). Its ``__metadata__`` holds one entry, ``"fsdp_optim"``, a
JSON document (:class:`Document`)::

    {"format": "fsdp_optim.named_safetensors", "version": 2, "optimizer": "Adam",
     "param_order": ["embed.weight", ...],                     # what ids are numbered by (see fullstate)
     "shapes_known": true, "shapes": {"embed.weight": [11, 6], ...},
     "param_groups": [{"hyperparams": {"lr": 0.01, "betas": {"$tuple": [0.9, 0.999]}, ...},
                       "params": ["embed.weight", ...], "named": false}, ...],
     "state": {"embed.weight": [{"key": "step", "kind": "scalar", "tensor": "embed.weight/step"},
                                {"key": "exp_avg", "kind": "full", "tensor": "embed.weight/exp_avg"}, ...]},
     "tensors": {"embed.weight/exp_avg": {"digest": "xxh3-128:...", "chunks": ["xxh3-128:...", ...]}, ...},
     "chunk_bytes": 1048576,
     "header": {"version": 1, "optimizer": "Adam", "world_size": 2, "scalar_keys": ["step"]}}

Keys: ``version`` 1 wrote ``kind`` ``"sharded"`` for ``"full"`` (read the same), 3 adds ``"whole"`` (:class:`Whole`);
``optimizer`` the ``torch.optim`` class name or ``null``; ``param_order`` every parameter by unwrapped name, in the
order a plain optimizer numbers them (``state_dict()`` id i is ``param_order[i]``), with or without state;
``shapes`` each parameter's shape (a full dict gives only those with state: ``shapes_known`` false);
``param_groups[].named``: whether the group also held a ``param_names`` list; ``state``: per parameter with state,
its entries in ``state_dict()`` order, a ``"scalar"`` a 0-dim tensor or a Python number in ``"value"`` instead of
``"tensor"``; ``header``: our full dict's ``"fsdp_optim"`` section.

Values that JSON alone would blur are tagged as the sharded manifest tags them
(:mod:`fsdp_optim.formats.sharded.manifest_json`: ``{"$tuple": [...]}``, ``{"$float": "inf"}``, ``{"$tensor": ...}``).

Checksums: ``digest`` (:func:`fsdp_optim.core.checksums.digest`) of the whole tensor; a tensor over
``chunk_bytes`` also has ``chunks``, the digests of its flat bytes cut into ``chunk_bytes`` pieces, so a reader of a
range reads and checks only the 1 MiB pieces that cover it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_optim.core.preconditions import check_version
from fsdp_optim.disk.json_input import RefusedJSON, loads
from fsdp_optim.formats.safetensors_container import (
    DTYPES,
    PORTABLE_DTYPES,
    HeaderError,
    HeaderRules,
    TensorSpan,
    read_file_header,
)
from fsdp_optim.formats.sharded.manifest_json import JSONValue, from_json, to_json

FORMAT = "fsdp_optim.named_safetensors"
VERSION = 3  # 2: a tensor entry's kind is "full" (1 wrote "sharded"); 3: a "whole" section (consolidate); all read
_OPTIMIZER_ONLY_VERSION = 2  # what a file without a "whole" section says (readable by a version-2 reader)
METADATA_KEY = "fsdp_optim"
# Bytes per chunk checksum of a named file's large tensors (a rank file's grid is segments.CHUNK_BYTES, 64 KiB:
# a rank reads a range of a rank file, while a named file is read tensor by tensor).
NAMED_CHUNK_BYTES = 1 << 20


class FormatError(ValueError):
    """A file that is not a readable named safetensors optimizer file; the message names the file and what is wrong."""


def decode(value: object, where: str) -> object:
    """:func:`~fsdp_optim.formats.sharded.manifest_json.from_json`, raising :class:`FormatError`."""
    try:
        return from_json(value, where)
    except ValueError as exc:
        raise FormatError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------
# The document


@dataclass(frozen=True)
class Entry:
    """One state key of one parameter: a tensor of the file (``tensor``) or a Python scalar (``value``)."""

    key: str
    kind: str  # "sharded" (shaped like the parameter) or "scalar" (0-dim tensor or Python value)
    tensor: str | None = None
    value: object = None


@dataclass(frozen=True)
class Group:
    hyperparams: Mapping[str, Any]
    params: tuple[str, ...]  # parameter names, in id order
    named: bool


@dataclass(frozen=True)
class TensorInfo(TensorSpan):
    """A tensor of the file: its checked header fields and its checksums (``chunks`` empty: one piece, ``digest``)."""

    digest: str
    chunks: tuple[str, ...]


@dataclass(frozen=True)
class Whole:
    """The ``"whole"`` section (version 3, what ``consolidate -o FILE.safetensors`` writes of a whole checkpoint)::

        "whole": {"model": ["embed.weight", ..., "head.weight", "block1.seen"],   # state_dict() names, in its order
                  "rank": 0, "extra": "{\"rng\": {\"$extra\": 0}, ...}", "extra_tensors": ["extra/0"],
                  "aliases": [["head.weight", "embed.weight"]]}                   # (tied name, parameter), optional

    ``model``: each a tensor of the file under that very name (tied names as copies); ``extra``: the chosen
    ``rank``'s as a whole checkpoint's side file holds it, each tensor a reference ``{"$extra": k}`` to the file's
    tensor ``extra/<k>``; ``aliases``: ``None`` in a file written before they were listed (a reader then tells them
    apart by their bytes)."""

    model: tuple[str, ...]
    extra: str
    extra_tensors: tuple[str, ...]
    rank: int
    aliases: tuple[tuple[str, str], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": list(self.model), "rank": self.rank, "extra": self.extra,
                               "extra_tensors": list(self.extra_tensors)}  # fmt: skip
        if self.aliases is not None:
            out["aliases"] = [list(pair) for pair in self.aliases]
        return out


@dataclass(frozen=True)
class Document:
    """The ``"fsdp_optim"`` metadata, decoded (see the module docstring)."""

    optimizer: str | None
    param_order: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    shapes_known: bool
    groups: tuple[Group, ...]
    state: Mapping[str, tuple[Entry, ...]]
    header: Mapping[str, Any]
    chunk_bytes: int = NAMED_CHUNK_BYTES
    whole: Whole | None = None

    def to_json(self, checksums: Mapping[str, Mapping[str, Any]]) -> str:
        doc = {
            "format": FORMAT,
            "version": _OPTIMIZER_ONLY_VERSION if self.whole is None else VERSION,
            "optimizer": self.optimizer,
            "param_order": list(self.param_order),
            "shapes_known": self.shapes_known,
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
            "param_groups": [
                {"hyperparams": _hyperparams(g, group.hyperparams), "params": list(group.params), "named": group.named}
                for g, group in enumerate(self.groups)
            ],
            "state": {name: [_entry_json(name, e) for e in entries] for name, entries in self.state.items()},
            "tensors": checksums,
            "chunk_bytes": self.chunk_bytes,
            "header": to_json(dict(self.header), "the full dict's 'fsdp_optim' block"),
        }
        if self.whole is not None:
            doc["whole"] = self.whole.to_json()
        return json.dumps(doc, allow_nan=False, separators=(",", ":"))


def _hyperparams(g: int, hyperparams: Mapping[Any, Any]) -> dict[str, JSONValue]:
    bad = next((k for k in hyperparams if not isinstance(k, str)), None)
    if bad is not None:
        raise ValueError(f"param group {g} has hyperparameter key {bad!r}, a {type(bad).__name__}; expected strings")
    return {k: to_json(v, f"param group {g} hyperparameter '{k}'") for k, v in hyperparams.items()}


def _entry_json(name: str, e: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"key": e.key, "kind": "full" if e.kind == "sharded" else e.kind}
    if e.tensor is not None:
        out["tensor"] = e.tensor
    else:
        out["value"] = to_json(e.value, f"scalar state '{e.key}' of parameter '{name}'")
    return out


def _get(d: object, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``d[key]``, checked to be of ``kind`` (never a bool for an int)."""
    if not isinstance(d, dict) or key not in d:
        raise FormatError(f"{where}: missing '{key}'")
    value = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise FormatError(f"{where}: '{key}' must be {expected}, found {json.dumps(value)[:60]}")
    return value


def parse_document(text: str, where: str) -> tuple[Document, dict[str, Any]]:
    """The decoded document and its raw ``"tensors"`` map (checksums), every field checked."""
    try:
        doc = loads(text, where=f"{where}: the '{METADATA_KEY}' metadata")
    except RefusedJSON as exc:
        raise FormatError(str(exc)) from None
    except ValueError as exc:
        raise FormatError(f"{where}: the '{METADATA_KEY}' metadata is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise FormatError(f"{where}: the '{METADATA_KEY}' metadata says format {found!r}, expected {FORMAT!r}")
    try:
        check_version(doc.get("version"), where, VERSION)
    except ValueError as exc:
        raise FormatError(str(exc)) from None
    order = tuple(_get(doc, "param_order", list, where))
    shapes_raw = _get(doc, "shapes", dict, where)
    shapes = {n: tuple(_shape(s, f"{where}: shape of '{n}'")) for n, s in shapes_raw.items()}
    groups = []
    for g, raw in enumerate(_get(doc, "param_groups", list, where)):
        at = f"{where}: param group {g}"
        hyper = {k: decode(v, f"{at} hyperparameter '{k}'") for k, v in _get(raw, "hyperparams", dict, at).items()}
        groups.append(Group(hyper, tuple(_get(raw, "params", list, at)), _get(raw, "named", bool, at)))
    raw_state = _get(doc, "state", dict, where)
    state = {name: tuple(_entry(e, name, where) for e in _get(raw_state, name, list, f"{where}: 'state'"))
             for name in raw_state}  # fmt: skip
    names = set(order)
    for name in [*state, *(n for g in groups for n in g.params), *shapes]:
        if not isinstance(name, str) or name not in names:
            raise FormatError(f"{where}: parameter {name!r} is not in 'param_order'")
    chunk_bytes = _get(doc, "chunk_bytes", int, where)
    if chunk_bytes < 64 or chunk_bytes % 64:
        raise FormatError(f"{where}: 'chunk_bytes' is {chunk_bytes}, expected a positive multiple of 64")
    header = decode(_get(doc, "header", dict, where), f"{where}: 'header'")
    if not isinstance(header, dict):  # a tagged object decodes to a tuple, a number or a tensor
        raise FormatError(f"{where}: 'header' must be an object, found a {type(header).__name__}")
    optimizer = _get(doc, "optimizer", (str, type(None)), where)
    known = _get(doc, "shapes_known", bool, where)
    document = Document(optimizer, order, shapes, known, tuple(groups), state, header, chunk_bytes, _whole(doc, where))
    return document, _get(doc, "tensors", dict, where)


def _whole(doc: dict[str, Any], where: str) -> Whole | None:
    if "whole" not in doc:
        return None
    at = f"{where}: 'whole'"
    raw = _get(doc, "whole", dict, where)
    model, extras = _get(raw, "model", list, at), _get(raw, "extra_tensors", list, at)
    if not all(isinstance(n, str) for n in [*model, *extras]) or len({*model, *extras}) != len(model) + len(extras):
        raise FormatError(f"{at}: 'model' and 'extra_tensors' must list distinct tensor names")
    aliases = None
    if "aliases" in raw:
        pairs = _get(raw, "aliases", list, at)
        if not all(isinstance(p, list) and len(p) == 2 and p[0] in model and p[1] in model for p in pairs):
            raise FormatError(f"{at}: 'aliases' must list [tied name, parameter name] pairs of 'model' names")
        aliases = tuple((str(a), str(b)) for a, b in pairs)
    rank = _get(raw, "rank", int, at)
    return Whole(tuple(model), _get(raw, "extra", str, at), tuple(extras), rank, aliases)


def _entry(raw: Any, name: str, where: str) -> Entry:
    at = f"{where}: state of parameter '{name}'"
    key = _get(raw, "key", str, at)
    kind = _get(raw, "kind", str, at)
    if kind not in ("full", "sharded", "scalar"):
        raise FormatError(f"{at}: state '{key}' has kind {kind!r}, expected 'full' or 'scalar'")
    kind = "sharded" if kind == "full" else kind  # version 1 wrote "sharded" (the engine's word) for "full"
    if "tensor" in raw:
        return Entry(key, kind, tensor=_get(raw, "tensor", str, at))
    if kind == "sharded" or "value" not in raw:
        raise FormatError(f"{at}: state '{key}' names no tensor" + ("" if kind == "sharded" else " and has no 'value'"))
    return Entry(key, kind, value=decode(raw["value"], f"{at}, state '{key}'"))


def _shape(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        raise FormatError(f"{where}: expected a list of non-negative ints, found {json.dumps(value)[:60]}")
    return value


# ---------------------------------------------------------------------------------------------------
# The file header

def _portable(at: str, name: str, dtype: str, shape: list[int]) -> None:  # noqa: ARG001 - the rules' signature
    """A named file is for any safetensors reader: no dtype that not every reader names."""
    if DTYPES[dtype] not in PORTABLE_DTYPES:
        raise HeaderError(f"{at} has dtype {dtype!r}, expected one of {sorted(PORTABLE_DTYPES.values())}")


NAMED_HEADER_RULES = HeaderRules(entry=_portable)


def read_named_header(path: str | os.PathLike[str]) -> tuple[Document, dict[str, TensorInfo]]:
    """The checked document and every tensor's place in the file, before any data is read: the container's checks
    (:func:`~fsdp_optim.formats.safetensors_container.read_header`, portable dtypes only), then the document's, and
    that it names every tensor of the header, with its checksums; :class:`FormatError` naming the file."""
    where = str(path)
    try:
        header = read_file_header(path, NAMED_HEADER_RULES)
    except HeaderError as exc:
        raise FormatError(str(exc)) from None
    text = header.metadata.get(METADATA_KEY)
    if text is None:
        raise FormatError(
            f"{where}: a safetensors file without fsdp_optim's '{METADATA_KEY}' metadata (not a named optimizer "
            "state file)"
        )
    document, checksums = parse_document(text, where)
    tensors = {name: _tensor(name, span, checksums, where) for name, span in header.tensors.items()}
    _check_names(document, tensors, where)
    return document, tensors


def _tensor(name: str, span: TensorSpan, checksums: Mapping[str, Any], where: str) -> TensorInfo:
    at = f"{where}: tensor '{name}'"
    sums = checksums.get(name)
    if not isinstance(sums, dict) or not isinstance(sums.get("digest"), str):
        raise FormatError(f"{at} has no checksum in the '{METADATA_KEY}' metadata")
    chunks = sums.get("chunks", [])
    if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
        raise FormatError(f"{at}: its chunk checksums must be a list of strings")
    return TensorInfo(span.dtype, span.shape, span.start, span.nbytes, sums["digest"], tuple(chunks))


def _check_names(document: Document, tensors: Mapping[str, TensorInfo], where: str) -> None:
    named = set()
    for name, entries in document.state.items():
        for e in entries:
            if e.tensor is None:
                continue
            info = tensors.get(e.tensor)
            if info is None:
                raise FormatError(
                    f"{where}: state '{e.key}' of parameter '{name}' names tensor '{e.tensor}', which the file lacks"
                )
            want = () if e.kind == "scalar" else document.shapes.get(name, info.shape)
            if info.shape != want:
                raise FormatError(f"{where}: tensor '{e.tensor}' has shape {list(info.shape)}, expected {list(want)}")
            if e.tensor in named:
                raise FormatError(f"{where}: tensor '{e.tensor}' is named by two state entries")
            named.add(e.tensor)
            chunks = chunk_digests_needed(info.nbytes, document.chunk_bytes)
            if len(info.chunks) != chunks:
                found = len(info.chunks)
                raise FormatError(f"{where}: tensor '{e.tensor}' has {found} chunk checksums, expected {chunks}")
    for name in () if document.whole is None else (*document.whole.model, *document.whole.extra_tensors):
        info = tensors.get(name)
        if info is None or name in named:
            lacks = "the file lacks it" if info is None else "a state entry names it too"
            raise FormatError(f"{where}: model tensor '{name}' of the 'whole' section: {lacks}")
        named.add(name)
        if len(info.chunks) != chunk_digests_needed(info.nbytes, document.chunk_bytes):
            raise FormatError(f"{where}: model tensor '{name}' has {len(info.chunks)} chunk checksums")
    extra = sorted(set(tensors) - named)
    if extra:
        raise FormatError(f"{where}: tensor '{extra[0]}' (and {len(extra) - 1} more) belongs to no parameter's state")


def chunk_digests_needed(nbytes: int, chunk_bytes: int = NAMED_CHUNK_BYTES) -> int:
    """How many chunk checksums a tensor of ``nbytes`` carries (0: only its whole digest)."""
    return math.ceil(nbytes / chunk_bytes) if nbytes > chunk_bytes else 0

