"""Sharded optimizer checkpoints inside a training job: save, load (with resharding), scatter a full dict, for any
fairscale FSDP root. Orchestration only: every check and cut is :mod:`fsdp_optim.core.plan`'s."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fsdp_optim.core.execute import cut_rank, optimizer_state_dict, saved_ranks
from fsdp_optim.core.plan import plan
from fsdp_optim.core.preconditions import check_rank
from fsdp_optim.disk.location import Location, ObjectPath, base_name, exists, uploaded
from fsdp_optim.disk.locations import where
from fsdp_optim.disk.one_file import write_stream
from fsdp_optim.formats.sharded.byte_ranges import cut_spans
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAMES, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.reader import open_checkpoint
from fsdp_optim.job.agreed import interrupts_deferred, step
from fsdp_optim.job.api import full_plan
from fsdp_optim.job.local import check_optimizer
from fsdp_optim.job.ring_load import optimizer_state_on_device, read_own
from fsdp_optim.job.root import Root, verify_root
from fsdp_optim.job.save_commit import check_in_seconds, commit_save, own_tensor, read_for_save, start_save
from fsdp_optim.job.transport import check_in, scatter_objects

__all__ = ["load_sharded_optim_state", "save_layout", "save_sharded_optim_state", "scatter_full_optim_state"]


def save_sharded_optim_state(
    fsdp: nn.Module,
    optim: torch.optim.Optimizer,
    directory: str | os.PathLike[str] | Location,
    *,
    overwrite: bool = False,
) -> Path | ObjectPath:
    """Write this rank's optimizer shard and, on rank 0, the manifest. A collective: call on every rank.

    No gather and no full buffer: every rank writes its own flat shards as they are (padding included)
    to ``directory/optim-<save id>-rank<r>-of-<W>.safetensors``; rank 0 then writes ``manifest.json`` with the layout
    (see :mod:`fsdp_optim.formats.sharded.manifest`). The manifest is committed last, so a crash at any point leaves
    the previous checkpoint in ``directory`` loadable; files of earlier saves are removed only after the new manifest
    is in place. ``directory`` must be one path that every rank sees (a shared file system, or a store).

    Never modifies ``optim`` or its state. Returns the manifest's path (on every rank): a ``pathlib.Path`` in a local
    directory, an :class:`~fsdp_optim.disk.location.ObjectPath` (printed as its URL) elsewhere. A failure on any rank
    raises on every rank, and then no manifest was written and the files this save wrote are removed. A concurrent
    writer of the same directory gets ``OutputLockedError``; a directory holding files that are not an fsdp_optim
    checkpoint's, ``ForeignOutputError`` unless ``overwrite``.

    Cost: four small object collectives (lock outcome, save id, per-rank summaries to rank 0, outcome)
    and each rank's own file write.
    """
    with interrupts_deferred("save_sharded_optim_state"):  # a Ctrl-C: the save ends as agreed, then raises
        root = verify_root(fsdp)
        check_in("save_sharded_optim_state", root.group, check_in_seconds())  # a rank calling it alone: said so
        local = read_for_save(root, optim)
        target = where(directory)
        state = {i: {key: own_tensor(v) for key, v in entries.items()} for i, entries in local.state.items()}
        save_id, lock = start_save(target, root.group, overwrite=overwrite, purpose="save_sharded_optim_state")
        return commit_save(root.layout, local, state, type(optim).__name__, target, save_id, root.group, lock=lock)


def save_layout(fsdp: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write the model's layout (units, names, shapes, dtypes, world size; no state) to ``path``. Local.

    The file stands in for the model where a layout is needed offline: ``reshard`` of a full dict,
    ``convert`` of a fairscale-native dict, ``fsdp-optim ... --layout FILE``.
    """
    manifest = Manifest.from_layout(verify_root(fsdp).layout.at_rank(0), save_id="layout")
    data = manifest_to_json(manifest)  # a manifest without files, in JSON: no pickle (format 1 wrote a torch file)
    place = where(path)
    with place.written_here(partial(uploaded, place)) as (local, _):  # in place, or a local copy uploaded whole
        write_stream(lambda file: file.write(data), Path(local), purpose="save_layout")  # under the file's lock
    return place.parent() / base_name(place)  # type: ignore[return-value]  # (a store's: shown as its URL)


def load_sharded_optim_state(
    fsdp: nn.Module, optim: torch.optim.Optimizer, path: str | os.PathLike[str] | Location, *, src_rank: int = 0
) -> None:
    """Load a checkpoint into this rank's ``optim``, all or nothing on every rank.

    - ``path`` a sharded checkpoint directory (or its manifest): a collective over ``fsdp``'s process group
      (one small all-gather of each rank's outcome, :func:`~fsdp_optim.job.transport.agree`). At the saved
      world size and layout each rank reads only its own file; otherwise (another world size, another FSDP
      nesting of the same parameters) each rank re-cuts its shard from the parts of the rank files that
      overlap it, one unit at a time. Every rank checks and reads its state into new memory first; only when
      every rank succeeded does any rank call ``optim.load_state_dict``. A damaged rank file (or any other
      failure on one rank) raises on every rank: the failing rank its own error, the others that error's type
      and message with the rank that raised it, and no optimizer is changed anywhere.
    - ``path`` a file holding a full dict (or a fairscale-native one): a collective, see
      :func:`scatter_full_optim_state`; only ``src_rank`` reads the file.

    Everything is checked before the optimizer is touched (one plan): optimizer class, parameter names
    and shapes, param groups, state keys and dtypes, checksums. Errors are ``ValueError`` naming the
    parameter or file, with what was expected and what was found.
    """
    root = verify_root(fsdp, optim)
    local = cast("str | os.PathLike[str]", path)  # (read as a file only where it names one)
    place = where(path)  # resolved once
    if not (exists(place) or base_name(place) in MANIFEST_NAMES):  # a full dict file, which only src_rank may see
        _refuse_shard_set(local)
        what = f"load_sharded_optim_state({str(path)!r}) loaded nothing"
        _scatter(root, optim, local, src_rank, what=what)
        return
    with step(f"load_sharded_optim_state({str(path)!r}) changed no optimizer", group=root.group):
        loaded = _read_sharded(root, optim, place)  # (before any optimizer is touched)
    optim.load_state_dict(optimizer_state_on_device(optim, loaded))


def _read_sharded(
    root: Root, optim: torch.optim.Optimizer, path: str | os.PathLike[str] | Location
) -> dict[str, Any]:
    """This rank's state from a sharded checkpoint, read into new memory, as ``optim.load_state_dict`` takes it."""
    layout, members, rank = root.layout, root.members, root.rank
    with open_checkpoint(path) as ckpt:  # lazy: at the saved layout a rank reads only its own file
        check_optimizer(ckpt.manifest.optimizer, optim, str(ckpt.directory))
        the_plan = plan(ckpt.source(), layout, members=members)
        if the_plan.identity:  # its own file, into new memory on the parameters' GPU (through its ring) or host
            own = read_own(ckpt, rank, [p.device for p in root.params], lambda i, _: i in the_plan.flats)
            state = {i: own[i] for i in the_plan.flats}
        else:
            # Before cut_rank allocates what the manifest declares: the rank files this rank reads, checked
            # (found by interval lookup; a rank re-cut from W to W/2 reads about two files, not W).
            ckpt.open_ranks(saved_ranks(the_plan, rank) or [0])
            with ckpt.fetched_ahead(lambda: cut_spans(ckpt, the_plan, [rank])):  # (where its location does)
                state = cut_rank(the_plan, rank, after_unit=ckpt.trim)
    return optimizer_state_dict(the_plan, state)


def scatter_full_optim_state(
    fsdp: nn.Module,
    optim: torch.optim.Optimizer,
    full: Mapping[str, Any] | str | os.PathLike[str] | None,
    *,
    src_rank: int = 0,
) -> None:
    """Load a full dict that only ``src_rank`` holds (or reads from a file) into every rank's ``optim``.

    A collective over ``fsdp``'s process group; ``full`` is ignored on other ranks (pass ``None``).
    ``src_rank`` checks the dict against the model and optimizer once (one plan, as
    ``get_shard_from_optim_state_dict`` does), then cuts and sends each rank its own padded shards, one
    rank at a time: no rank but ``src_rank`` ever holds more than its own shard, and ``src_rank`` holds
    the dict (memory-mapped when read from a file; a named safetensors file is read one rank's ranges at a
    time, each checked) plus one rank's shard. A fairscale-native dict is
    accepted too (the model gives its layout). A dict the model refuses raises the same error on every rank.

    Cost: one small all-gather (the outcome of the check), then per other rank one pickled skeleton plus
    one message per state tensor, then one small all-gather.
    """
    _scatter(verify_root(fsdp, optim), optim, full, src_rank, what="scatter_full_optim_state refused the full dict")


def _scatter(
    root: Root,
    optim: torch.optim.Optimizer,
    full: Mapping[str, Any] | str | os.PathLike[str] | None,
    src_rank: int,
    *,
    what: str,
) -> None:
    """:func:`scatter_full_optim_state` on a root verified with ``optim``; ``what`` names the caller in a refusal."""
    check_rank("src_rank", src_rank, root.world_size)
    make: Callable[[int], dict[str, Any]] | None = None
    own: dict[str, Any] | None = None
    with step(what, group=root.group):
        if root.rank == src_rank:  # the one plan, checked once, then cut for each rank (no rank but src reads)
            if full is None:
                raise ValueError(f"full: rank {src_rank} (src_rank) must pass the full dict or its file, found None")
            the_plan = full_plan(root, full, optim)
            make = lambda r: optimizer_state_dict(the_plan, cut_rank(the_plan, r))  # noqa: E731
            own = make(root.rank)
    # After the step, src_rank holds a plan (or it would have raised) and the other ranks only receive.
    optim.load_state_dict(optimizer_state_on_device(optim, scatter_objects(make, own, src=src_rank, group=root.group)))


def _refuse_shard_set(path: str | os.PathLike[str]) -> None:
    """A fairseq/metaseq shard set (a prefix or one ``-shard<r>.pt`` file) is not a full dict: say what it is."""
    from fsdp_optim.formats.fairseq.paths import is_shard_set

    if is_shard_set(path):
        raise ValueError(
            f"{path}: a fairseq/metaseq shard set (files {Path(path).name}-shard<r>.pt or one of them), which "
            "load_sharded_optim_state does not read; it loads an fsdp_optim sharded checkpoint directory or a full "
            f"dict file: write one with `fsdp-optim reshard {path} ...` (another world size) or "
            f"`fsdp-optim convert {path} -o full.pt`, then load that"
        )
