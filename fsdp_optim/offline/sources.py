"""The one way in: what kind of input a path or dict is, decided once (:func:`detect`), and opened as a planning
source (:func:`open_source`). Every offline function and every CLI verb starts here; the options that depend
on the kind (``layout``, ``optimizer``, ``allow_globals``, ``optimizer_keys``) are accepted or refused here, by
one table, which each kind's class carries (``LAYOUT``, ``OPTIMIZER``, ``SET_OPTIONS``, ``WRITTEN_ONLY``); then the
class opens the input (``opening``: its files mapped until the block ends; ``loaded``: from what ``detect`` loaded).

    kind                        what it is                                       layout        optimizer
    sharded checkpoint          a directory of ours (or its manifest)            refused       refused
    layout file                 save_layout's file (a manifest, no rank files)   refused       refused
    rank file                   one rank's file of a sharded checkpoint          refused       refused
    full dict                   gather_full_optim_state_dict's output            target only   refused
    fairscale-native dict       fairscale's own gather output (ids, no names)    required      checked
    fairseq/metaseq shard set   use_sharded_state files (..-shard<r>.pt)         param order   checked
    named safetensors file      to_safetensors' file (<name>/<key> tensors)      target only   refused
    whole checkpoint file       consolidate's {'model', 'optimizer', 'extra'}    target only   refused
                                (its one safetensors file: a named safetensors file with a "whole" section, read the
                                same way)
    Hugging Face layout         convert --to safetensors' model files (+ optimizer.safetensors)  target only  refused
    name-keyed dict, DCP dir    what convert --to named / --to dcp write         inspect only
                                (reshard keeps the set's own order and optimizer: both refused there)

"target only": a full dict has no FSDP units; a verb that cuts it (reshard) takes the model's layout as its
target, or, for a file consolidate wrote, the layout the file records (its checkpoint's) when none is given.
"checked": the name must be a known optimizer whose state keys are the ones found
(:func:`fsdp_optim.core.elementwise.check_optimizer_name`). ``allow_globals`` applies to shard sets only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from fsdp_optim.disk.location import as_local_file
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.objects import check_state_dict
from fsdp_optim.disk.untrusted import load_file
from fsdp_optim.formats.kinds import Given, Kind, detect
from fsdp_optim.formats.plain import ParamNames, name_plain_dict
from fsdp_optim.formats.sharded.locate import is_sharded_checkpoint
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME
from fsdp_optim.formats.sharded.reader import DEFAULT_MAPPED_BYTES
from fsdp_optim.offline.layouts import ParamOrder
from fsdp_optim.offline.opened import class_of
from fsdp_optim.offline.opened.base import NEEDS_LAYOUT, Opened, Request

__all__ = ["fetched_whole", "open_source"]


_LAYOUT_USE = (
    "--layout applies to a fairscale-native dict (required: it names the parameters), a fairseq/metaseq shard set "
    "(the model's parameter order) and, for reshard, a full dict or a consolidated whole checkpoint file (the "
    "target's units)"
)


G = TypeVar("G", bound=Given)  # what fetched_whole hands back when it downloads nothing

def _check_options(
    kind: Kind,
    label: str,
    *,
    layout: ParamOrder,
    optimizer: str | None,
    allow_globals: Sequence[str],
    target: bool,
    optimizer_keys: Sequence[Sequence[str]] | None = None,
) -> None:
    """Refuse an option that does not apply to ``kind`` (the table of the module docstring: each kind's class says
    which it takes), the same way for every entry point; ``target``: the caller cuts the source for a layout of its
    own (reshard)."""
    cls = class_of(kind)
    use = cls.layout_use(target=target)
    if target:
        cls.check_target_options(label, optimizer)
    if layout is not None and (use is None or (use == "target" and not target)):
        raise ValueError(f"layout: {label} is a {kind.value}; {_LAYOUT_USE}")
    if layout is None and use == "required":
        raise ValueError(
            f"layout: {label} is a {kind.value}, which names no parameters; fsdp_optim needs --layout PATH "
            f"(layout=): {NEEDS_LAYOUT}"
        )
    if optimizer is not None and not cls.OPTIMIZER:
        raise ValueError(
            f"optimizer: {label} is a {kind.value}, which records its optimizer; --optimizer applies to a "
            "fairscale-native dict or a fairseq/metaseq shard set only"
        )
    if optimizer_keys is not None and not cls.SET_OPTIONS:
        raise ValueError(f"optimizer_keys: {label} is a {kind.value}; it applies to fairseq/metaseq shard sets")
    if allow_globals and not cls.SET_OPTIONS:
        raise ValueError(f"allow_globals: {label} is a {kind.value}; it applies to fairseq/metaseq shard sets")


@contextlib.contextmanager
def open_source(
    given: Given,
    *,
    layout: ParamOrder = None,
    optimizer: str | None = None,
    allow_globals: Sequence[str] = (),
    optimizer_keys: Sequence[Sequence[str]] | None = None,
    target: bool = False,
    describe_only: bool = False,
    max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
    param_names: ParamNames | None = None,
) -> Iterator[Opened]:
    """Decide what ``given`` is (once), check the options against it, and open it; files stay open (memory-mapped)
    until the block ends. ``target``: the caller cuts the source for a layout of its own (see the table);
    ``describe_only`` (inspect): a fairscale-native dict is opened without a layout, as ``raw`` only.
    ``param_names``: ``given`` is a plain optimizer's ``state_dict()``, named by these (a module, names or
    ``{name: shape}``: :func:`fsdp_optim.formats.plain.name_optimizer_state`) into a full dict."""
    with fetched_whole(given) as local:  # (a URL of one object: fetched first)
        label = "the full dict" if isinstance(local, Mapping) else str(local)
        if param_names is not None:
            yield _open_plain(local, label, param_names, layout=layout, optimizer=optimizer, target=target)
            return
        kind, obj = detect(local)
        cls = class_of(kind)
        request = Request(kind, local, label, obj, layout, optimizer, allow_globals, optimizer_keys, max_mapped_bytes)
        quick = cls.for_inspect(request) if describe_only else None
        if quick is not None:
            yield quick
            return
        if cls.WRITTEN_ONLY is not None:
            raise ValueError(f"{label}: a {kind.value}, which fsdp-optim writes and inspects only; {cls.WRITTEN_ONLY}")
        _check_options(kind, label, layout=layout, optimizer=optimizer, allow_globals=allow_globals, target=target,
                       optimizer_keys=optimizer_keys)  # fmt: skip
        with cls.opening(request) as opened:
            yield opened


@contextlib.contextmanager
def fetched_whole(given: G) -> Iterator[G | str | os.PathLike[str]]:
    """``given`` as the readers that take a local file open it: itself (a dict, a sharded checkpoint, a local path),
    or, for one object of a location whose objects are no local files, a copy fetched whole and removed when the
    block ends: the one place such an object is fetched (``open_source``, ``verify``)."""
    if not isinstance(given, (str, os.PathLike)) or is_sharded_checkpoint(given):
        yield given
        return
    with contextlib.ExitStack() as stack:
        try:
            local = stack.enter_context(as_local_file(where(given)))
        except FileNotFoundError:  # (only while fetching: the block's own errors pass as they are)
            raise FileNotFoundError(
                f"{str(given).rstrip('/')}: no such object, and no {MANIFEST_NAME} under it (not a sharded "
                "checkpoint's prefix either)"
            ) from None
        yield local


def _open_plain(
    given: Given, label: str, names: ParamNames, *, layout: ParamOrder, optimizer: str | None, target: bool
) -> Opened:
    """A plain optimizer's ``state_dict()`` (a dict, or a torch file through the untrusted gate) named into a
    full dict."""
    obj = given if isinstance(given, Mapping) else load_file(given, mmap=True, disjoint=True)
    if not isinstance(given, Mapping):
        check_state_dict(obj, label)
    _check_options(Kind.FULL, label, layout=layout, optimizer=optimizer, allow_globals=(), target=target)
    full = name_plain_dict(obj, names, optimizer=None, where=label)
    return class_of(Kind.FULL).loaded(Request(Kind.FULL, given, label, full, layout, optimizer))
