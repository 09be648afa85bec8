"""An opened input: one small interface, one class per kind of input (:func:`fsdp_optim.offline.sources.open_source`
decides the kind once and builds the class). The verbs ask the opened input; none asks which kind it has.

Every opened input answers the same questions (:class:`.base.Opened` in ``base.py``, with the answer of a kind that
cannot: most often a refusal that says what the input is and what was expected)::

    opened.kind, opened.label       what it is, how errors name it
    opened.source                   its optimizer state as a planning Source (None: a layout file, a rank file)
    opened.layout, opened.order     the units it was saved with (None without), the parameter order
    opened.trim()                   drop file mappings touched so far
    opened.describe(path, units=)   inspect's lines
    opened.report(path, lines)      the same as one JSON object (:mod:`fsdp_optim.offline.report`)
    class_of(kind).verify_files(path, allow_globals)   ``verify``'s check of every file of an input of that kind,
                                    which may be damaged: by its names and first bytes, never opened
                                    (:mod:`fsdp_optim.offline.verdicts`)

    opened.full_state(progress=)    consolidate's full dict of its optimizer state (a shard set's with its extras)
    opened.full_dict(progress=)     the full dict it is (a full dict file: itself) or gives
    opened.consolidated(rank=, with_model=, progress=)   what fsdp_optim.consolidate returns
    opened.write_consolidated(output, ...) / write_resharded(world_size, out, ...)   the CLI verbs' writes, each
                                    returning a record of what it wrote (``written.py``; the CLI words it)
    opened.reshard(world_size, out, layout=, given=, ...)   fsdp_optim.reshard into a local directory
    opened.is_full_dict(), is_whole(), holds_weights()   what it holds
    opened.whole_model(rank=, progress=), whole_source(), side_state(), check_rank(rank)   a whole checkpoint's
                                    model, weights as "@param", buffers and extra, saved ranks
    opened.dcp_parts(), named_header()   what DCP export and named safetensors writing take of it

Each kind's class keeps its own reader as a field of its own; ``_HOMES`` below says which module holds the class.
"""

from __future__ import annotations

import importlib
from typing import cast

from fsdp_optim.formats.kinds import Kind
from fsdp_optim.offline.opened.base import Opened

__all__ = ["class_of"]


# The class of each kind of input (``module.Class`` here): the one place a kind picks its class. A class is imported
# when its kind is first opened, so reading our own checkpoint loads no other format's reader.
_HOMES: dict[Kind, str] = {
    Kind.SHARDED: "sharded.OpenedCheckpoint", Kind.LAYOUT: "sharded.OpenedLayout", Kind.HF: "readers.OpenedHf",
    Kind.RANK_FILE: "sharded.OpenedRankFile", Kind.FULL: "loaded.OpenedFull", Kind.NATIVE: "loaded.OpenedNative",
    Kind.NAMED_DICT: "loaded.OpenedNamedDict", Kind.WHOLE_FILE: "loaded.OpenedWholeFile", Kind.DCP: "readers.OpenedDcp",
    Kind.SHARD_SET: "readers.OpenedShardSet", Kind.NAMED: "readers.OpenedNamed",
}  # fmt: skip


def class_of(kind: Kind | None) -> type[Opened]:
    """The class of inputs of ``kind``; ``None`` (a torch file not loaded yet, whatever it holds):
    :class:`.base.Opened`, whose class methods treat it as the torch file it is."""
    if kind is None:
        return Opened
    module, _, name = _HOMES[kind].partition(".")
    return cast(type[Opened], getattr(importlib.import_module(f"{__name__}.{module}"), name))
