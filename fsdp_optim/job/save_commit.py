"""The save protocol every job save shares (optimizer-only, whole, synchronous, asynchronous, to any
:class:`~fsdp_optim.disk.location.Location`): :func:`start_save` before any rank writes, :func:`commit_save` to write
and commit. The location does what differs between backends, in the order its docstring gives:

    start_save (rank 0)   location.begin_save: refuse foreign content, note what the commit replaces
    commit_save (each)    location.stage, write the rank file (+ side file) there, location.publish
                (rank 0)  gather every rank's file records, build the manifest, location.commit_manifest (last),
                          then agree: all ranks succeed or all raise; location.finish_save (every rank: rank 0
                          releases what it began; the memory tier's ranks seal the step together) and, after a
                          failure, location.finish_save (rank 0, failed) and location.discard (each rank)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fsdp_optim.core.elementwise import check_elementwise, state_keys
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.records import GroupRecord, state_entries
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.errors import CommitOutcomeUnknown
from fsdp_optim.disk.location import Begun, Location, ObjectPath, Staging
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.json_values import to_json
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.training import TrainingRecord
from fsdp_optim.formats.sharded.writer import save_rules, write_shard_file
from fsdp_optim.job.local import LocalState, check_agreement, read_local_state, with_scalars
from fsdp_optim.job.root import Root
from fsdp_optim.job.stager import pieces
from fsdp_optim.job.transport import (
    ProcessGroup,
    agree,
    broadcast_object,
    dist_rank_and_size,
    gather_objects,
)

__all__ = ["Side", "check_in_seconds", "commit_save", "own_tensor", "read_for_save", "start_save"]

_SAFE_LEAVES = (type(None), bool, int, float, complex, str, torch.Tensor)
CHECK_IN_ENV = "FSDP_OPTIM_CHECK_IN_S"
CHECK_IN_DEFAULT_S = 600.0


def check_in_seconds() -> float:
    """How long a save waits for every rank to call it before saying that one did not
    (:func:`~fsdp_optim.job.transport.check_in`): ``$FSDP_OPTIM_CHECK_IN_S`` seconds, default 600."""
    text = os.environ.get(CHECK_IN_ENV)
    try:
        value = float(text) if text else CHECK_IN_DEFAULT_S
    except ValueError:
        raise ValueError(f"${CHECK_IN_ENV}: expected a number of seconds, found {text!r}") from None
    if not value > 0:
        raise ValueError(f"${CHECK_IN_ENV}: expected a number of seconds > 0, found {text!r}")
    return value


def _check_loadable(value: Any, where: str) -> None:
    """Refuse values that ``torch.load(..., weights_only=True)`` could not read back."""
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_loadable(item, where)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_loadable(key, where)
            _check_loadable(item, where)
    elif not isinstance(value, _SAFE_LEAVES):
        raise TypeError(
            f"{where} is a {type(value).__name__}, which torch.load(weights_only=True) cannot read back; expected "
            "numbers, strings, bools, None, tensors, or lists/tuples/dicts of them"
        )


def own_tensor(value: Any) -> Any:
    """What a save keeps of a live value: a CPU tensor that ``torch.save`` writes without a larger backing storage;
    a tensor on a GPU as it is, detached (the writer, or an async save's staging, copies it through pinned memory:
    :mod:`fsdp_optim.job.stager`); other values as they are."""
    if not torch.is_tensor(value):
        return value
    value = value.detach()
    if value.device.type != "cpu":
        return value
    whole = value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    return value if whole else value.clone()


def start_save(
    directory: Location, group: ProcessGroup, *, overwrite: bool, purpose: str
) -> tuple[str, Begun | None]:
    """Before any rank writes: rank 0 begins the save at ``directory`` (:meth:`Location.begin_save`: a local
    directory is locked, what a killed writer left removed and the save journaled; a store's prefix is listed and its
    manifest's etag noted; foreign contents refused unless ``overwrite``). Every rank then learns the save id, or
    every rank raises rank 0's refusal, with nothing written. Returns ``(save id, what rank 0 began, None
    elsewhere)``; hand it to :func:`commit_save`. Two small collectives."""
    rank, world_size = dist_rank_and_size(group)
    save_id, failure = None, None
    lock: Begun | None = None
    if rank == 0:
        try:
            save_id = new_save_id()
            rules = save_rules(save_id, world_size)
            lock = directory.begin_save(rules, purpose=purpose, overwrite=overwrite)
        except Exception as exc:  # every rank learns of it through agree()
            failure = exc
    try:
        agree(failure, group=group, what=f"{purpose} refused {directory}, nothing was written")
        return broadcast_object(save_id, src=0, group=group), lock
    except BaseException:  # a Ctrl-C or a peer's failure here: nothing was written, and the lock is not left held
        if lock is not None:
            directory.finish_save(lock, failed=True)
        raise


def read_for_save(root: Root, optim: torch.optim.Optimizer, *, read_scalars: bool = True) -> LocalState:
    """This rank's optimizer state, checked to be savable (local; reads only). ``read_scalars=False`` (an async
    save's blocking part) reads no tensor's value: a 0-dim tensor is checked by its dtype, and its value is read from
    the save's own copy (:func:`commit_save`), so the caller never waits for the GPU."""
    check_elementwise(optim, where="optim", keys=state_keys(optim))
    layout = root.layout
    layout.check_world_sizes()
    local = read_local_state(layout, root.params, optim.state_dict(), optim.param_groups, read_scalars=read_scalars)
    for k, group in enumerate(local.groups):
        for key, value in group.hyperparams.items():
            _check_loadable(value, f"optim: hyperparameter '{key}' of param group {k}")
            to_json(value, f"optim: hyperparameter '{key}' of param group {k}")  # the JSON manifest holds it exactly
    for i, entries in local.state.items():
        for key, value in entries.items():
            where = f"optim: state '{key}' of {layout.flat_params[i].describe()}"
            _check_loadable(value, where)
            if not torch.is_tensor(value) or value.dim() == 0:  # a scalar: the manifest holds it
                unread = torch.is_tensor(value) and not read_scalars  # checked by its dtype alone
                to_json(torch.zeros((), dtype=value.dtype) if unread else value, where)
    return local


def commit_save(
    layout: ModelLayout,
    local: LocalState,
    state: Mapping[int, Mapping[str, Any]] | Callable[[], Mapping[int, Mapping[str, Any]]],
    optimizer: str | None,
    directory: Location,
    save_id: str,
    group: ProcessGroup,
    *,
    lock: Begun | None = None,
    side: Side | None = None,
) -> Path | ObjectPath:
    """Write this rank's ``state`` (``{flat: {key: padded shard or scalar}}``, or a function that makes it) and,
    for a whole checkpoint, its ``side`` file; then, once every rank's files are durable, rank 0's manifest (last).
    A collective over ``group``: a failure on any rank raises on every rank, and then no manifest was written.
    Shared by the synchronous and asynchronous saves and :func:`fsdp_optim.job.whole_save.save_checkpoint`.
    ``lock`` (rank 0): from :func:`start_save`; finished here (a failed save's files removed). ``None`` with a
    directory of this job's own (the memory tier's): the manifest is written last, nothing locked or replaced.
    Where the files go and how the manifest commits is ``directory``'s (:mod:`fsdp_optim.disk.location`)."""
    rank, world_size = dist_rank_and_size(group)
    own = _Written()
    failure: Exception | None = None
    manifest: Manifest | None = None
    summary = local.summary
    try:
        try:
            _write_own(own, state, side, directory, save_id, rank, world_size)
            summary = with_scalars(local.summary, own.shards)  # the values read_for_save left unread, from the copy
        except Exception as exc:  # every rank learns of it through agree(), and no manifest is written
            failure = exc
        reports = gather_objects((summary, own.record, own.aux), dst=0, group=group)  # None except on rank 0
        written = all(r is not None and (side is None or a is not None) for _, r, a in reports or ())
        if reports is not None and failure is None and written:  # every rank's files (a rank's failure: none)
            try:
                manifest = _commit(layout, local, own.shards, optimizer, save_id, reports, side, directory, lock)
            except Exception as exc:
                failure = exc
        what = "save_checkpoint" if side is not None else "save_sharded_optim_state"
        agree(failure, group=group, what=f"{what} failed, no checkpoint was written")
        own.committed = True  # every rank agreed: the manifest is in place, whatever interrupts us now
    except BaseException as exc:
        if own.committed:  # e.g. a Ctrl-C right after the agreement: the save stands, as on the other ranks
            if lock is not None:  # (rank 0's release alone: no collective after an interrupt)
                _finish_committed(directory, lock, manifest)
            note = f"(the save into {directory} had committed before this interrupt: its checkpoint is whole)"
            getattr(exc, "add_note", lambda _: None)(note)  # Python >= 3.11
            raise
        if lock is not None:
            directory.finish_save(lock, failed=True)
        if own.staging is not None and own.published and not isinstance(exc, CommitOutcomeUnknown):
            # (else the manifest may list them: kept; the next save's finish removes them if it does not)
            directory.discard(own.staging, own.published)
        raise
    finally:
        if own.staging is not None:
            directory.unstage(own.staging)
    _finish_committed(directory, lock, manifest)
    return directory / MANIFEST_NAME


def _finish_committed(directory: Location, lock: Begun | None, manifest: Manifest | None) -> None:
    """Every rank after a commit (:meth:`Location.finish_save`): rank 0 removes what the replaced checkpoint and
    failed writers left and releases the save (``lock``; ``None`` elsewhere, and for a save not begun)."""
    directory.finish_save(lock, failed=False, keep=frozenset(manifest.file_names()) if manifest else frozenset())


@dataclass
class _Written:
    """What this rank wrote for a save: its records, and where (its staging, the names published)."""

    record: FileRecord | None = None
    aux: FileRecord | None = None
    shards: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    staging: Staging | None = None
    published: list[str] = field(default_factory=list)
    committed: bool = False  # every rank agreed that the manifest is in place


def _write_own(
    own: _Written,
    state: Mapping[int, Mapping[str, Any]] | Callable[[], Mapping[int, Mapping[str, Any]]],
    side: Side | None,
    directory: Location,
    save_id: str,
    rank: int,
    world_size: int,
) -> None:
    """This rank's rank file (and side file) into the location's staging for it, then published there."""
    own.staging = staging = directory.stage(save_id, rank)
    staging.path.mkdir(parents=True, exist_ok=True)
    own.shards = state() if callable(state) else state  # (async save: its staging copy, a failure agreed on)
    own.record = write_shard_file(
        staging.path,
        own.shards,
        save_id=save_id,
        rank=rank,
        world_size=world_size,
        durable=staging.durable,
        pieces=pieces,
    )
    own.aux = side.write(staging.path, save_id, rank, world_size, durable=staging.durable) if side else None
    names = [own.record.file] + ([own.aux.file] if own.aux is not None else [])
    own.published = names  # (before publishing: a failure part way removes what went up)
    directory.publish(staging, names)


def _commit(
    layout: ModelLayout,
    local: LocalState,
    shards: Mapping[int, Mapping[str, Any]],
    optimizer: str | None,
    save_id: str,
    reports: list[Any],
    side: Side | None,
    directory: Location,
    lock: Begun | None,
) -> Manifest:
    """Rank 0, once every rank's files are written: the manifest, committed last (renamed into place, or put on the
    condition that the store's manifest is still the one :func:`start_save` found)."""
    if len(reports) > 1:
        check_agreement(layout, [summary for summary, _, _ in reports])
    files = [r for _, r, _ in reports]
    manifest = _manifest(layout, local.groups, shards, optimizer, save_id, files)
    if side is not None:
        manifest = replace(manifest, training=side.record(tuple(a for _, _, a in reports)))
    data = manifest_to_json(manifest)  # before anything is written: a value JSON cannot hold is refused here
    directory.commit_manifest(save_rules(save_id, len(files)), lock, data)
    return manifest


@dataclass(frozen=True)
class Side:
    """What a whole checkpoint writes beside each rank file: ``write(directory, save_id, rank, world_size, *,
    durable)`` makes the rank's side file, ``record(side files of every rank)`` the manifest's ``"training"``
    section (rank 0)."""

    write: Callable[..., FileRecord]  # (directory, save_id, rank, world_size, *, durable=True)
    record: Callable[[tuple[FileRecord, ...]], TrainingRecord]


def _manifest(
    layout: ModelLayout,
    groups: tuple[GroupRecord, ...],
    state: Mapping[int, Mapping[str, Any]],
    optimizer: str | None,
    save_id: str,
    files: list[Any],
) -> Manifest:
    entries = {i: state_entries(layout.flat_params[i], values) for i, values in state.items()}
    return Manifest.from_layout(
        layout.at_rank(0), save_id=save_id, optimizer=optimizer, state=entries, groups=groups, files=files
    )
