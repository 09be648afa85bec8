"""What every job save shares (optimizer-only, whole, synchronous, asynchronous, the memory tier, to any
:class:`~fsdp_optim.disk.location.Location`): :func:`start_save` before any rank writes, :func:`commit_save` to write
and commit, through the one save driver (:func:`fsdp_optim.disk.save.saving`; the location's writer does what
differs between backends):

    start_save (rank 0)   writer.begin: refuse foreign content, note what the commit replaces   -> agreed
    commit_save (each)    with saving(...) as save: write the rank file (+ side file) into save.staging,
                          save.publish; gather every rank's file records, rank 0 builds the manifest  -> agreed
                          save.commit(manifest on rank 0)   the commit point (rank 0's rename or conditional put;
                                                            the memory tier's seal on every rank)  -> agreed
                          leaving the block: writer.finish (rank 0: the replaced files removed, the save released),
                          or after a failure writer.abort
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from fsdp_optim.core.elementwise import check_elementwise, state_keys
from fsdp_optim.core.layout import ModelLayout
from fsdp_optim.core.records import state_entries
from fsdp_optim.disk.atomic import new_save_id
from fsdp_optim.disk.location import Location, ObjectPath
from fsdp_optim.disk.save import Begun, Save, saving
from fsdp_optim.formats.sharded.file_record import FileRecord
from fsdp_optim.formats.sharded.json_values import to_json
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_to_json
from fsdp_optim.formats.sharded.training import TrainingRecord
from fsdp_optim.formats.sharded.writer import save_rules, write_shard_file
from fsdp_optim.job.agreed import step
from fsdp_optim.job.local import LocalState, check_agreement, read_local_state, with_scalars
from fsdp_optim.job.root import Root
from fsdp_optim.job.stager import pieces
from fsdp_optim.job.transport import ProcessGroup, broadcast_object, dist_rank_and_size, gather_objects

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
    """What a save keeps of a live value: a CPU tensor without a larger backing storage; a GPU tensor detached (the
    writer copies it through pinned memory); other values as they are."""
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
    """Before any rank writes: rank 0 begins the save at ``directory`` (:meth:`~fsdp_optim.disk.save.Writer.begin`;
    foreign contents refused unless ``overwrite``); every rank learns the save id, or raises rank 0's refusal with
    nothing written. Returns ``(save id, what rank 0 began or None)`` for :func:`commit_save`. Two small collectives."""
    rank, world_size = dist_rank_and_size(group)
    save_id, begun = None, None
    try:
        with step(f"{purpose} refused {directory}, nothing was written", group=group):
            if rank == 0:
                save_id = new_save_id()
                begun = directory.writer(save_rules(save_id, world_size)).begin(purpose=purpose, overwrite=overwrite)
        return broadcast_object(save_id, src=0, group=group), begun
    except BaseException:  # a Ctrl-C or a peer's failure here: nothing was written, and the lock is not left held
        if begun is not None and begun.release is not None:
            begun.release(True)
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
    for a whole checkpoint, its ``side`` file; then commit rank 0's manifest (the module docstring). A failure on any
    rank raises on every rank, and then no manifest was written. ``lock`` (rank 0): from :func:`start_save`, finished
    here; ``None`` for a directory of this job's own (the memory tier's): nothing locked or replaced."""
    rank, world_size = dist_rank_and_size(group)
    what = "save_checkpoint" if side is not None else "save_sharded_optim_state"
    writer = directory.writer(save_rules(save_id, world_size))
    agreed = lambda text: step(f"{what} failed, {text}", group=group)  # noqa: E731
    with saving(writer, lock, save_id=save_id, rank=rank, agreed=agreed) as save:
        own, data, keep = _Written(summary=local.summary), None, frozenset[str]()
        with agreed("no checkpoint was written"):
            try:
                _write_own(save, own, state, side, save_id, rank, world_size)
                own.summary = with_scalars(local.summary, own.shards)  # the values read_for_save left unread
            finally:  # every rank reports, whatever happened (a failed rank: no files); rank 0 gathers
                reports = gather_objects((own.summary, own.record, own.aux), dst=0, group=group)
            written = all(r is not None and (side is None or a is not None) for _, r, a in reports or ())
            if reports is not None and written:  # rank 0, every rank's files there: the manifest, not yet committed
                manifest = _manifest_of(layout, local, own.shards, optimizer, save_id, reports, side)
                data, keep = manifest_to_json(manifest), frozenset(manifest.file_names())  # (bad JSON: refused)
        save.commit(data, keep=keep)
    return directory / MANIFEST_NAME


@dataclass
class _Written:
    """What this rank wrote for a save, as far as it got."""

    summary: Any
    record: FileRecord | None = None
    aux: FileRecord | None = None
    shards: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)


def _write_own(
    save: Save,
    own: _Written,
    state: Mapping[int, Mapping[str, Any]] | Callable[[], Mapping[int, Mapping[str, Any]]],
    side: Side | None,
    save_id: str,
    rank: int,
    world_size: int,
) -> None:
    """This rank's rank file (and side file) into its staging, then published."""
    staging = save.staging
    own.shards = state() if callable(state) else state  # (async save: its staging copy, a failure agreed on)
    own.record = write_shard_file(staging.path, own.shards, save_id=save_id, rank=rank, world_size=world_size,
                                  durable=staging.durable, pieces=pieces)  # fmt: skip
    own.aux = side.write(staging.path, save_id, rank, world_size, durable=staging.durable) if side else None
    save.publish([own.record.file] + ([own.aux.file] if own.aux is not None else []))


def _manifest_of(
    layout: ModelLayout, local: LocalState, shards: Mapping[int, Mapping[str, Any]], optimizer: str | None,
    save_id: str, reports: list[Any], side: Side | None,
) -> Manifest:  # fmt: skip
    """Rank 0: the manifest to commit (``reports``: every rank's ``(summary, rank file, side file)``)."""
    if len(reports) > 1:
        check_agreement(layout, [summary for summary, _, _ in reports])
    entries = {i: state_entries(layout.flat_params[i], values) for i, values in shards.items()}
    manifest = Manifest.from_layout(layout.at_rank(0), save_id=save_id, optimizer=optimizer, state=entries,
                                    groups=local.groups, files=[r for _, r, _ in reports])  # fmt: skip
    if side is not None:
        manifest = replace(manifest, training=side.record(tuple(a for _, _, a in reports)))
    return manifest


class Side(Protocol):
    """What a whole checkpoint writes beside each rank file (:func:`fsdp_optim.job.whole_save.prepare_whole`'s)."""

    def write(self, directory: Path, save_id: str, rank: int, size: int, *, durable: bool = True) -> FileRecord:
        """This rank's side file."""
        ...

    def record(self, files: tuple[FileRecord, ...]) -> TrainingRecord:
        """Rank 0: the manifest's ``"training"`` section, from every rank's side file."""
        ...
