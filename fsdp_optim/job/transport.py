"""The one module that talks to ``torch.distributed``.

Two ways to bring per-rank flat shards together: :func:`gather_flat_tensors` (the default) sends each rank's *real*
elements of each shard, padding excluded, straight into the slice of a fresh flat full tensor on the recipient (each
byte moves once; one message per flat parameter, state key and sending rank); :func:`broadcast_from_each_rank`
broadcasts each rank's pickled shard dict (kept for comparison). Metadata costs one all-gather of a 64-bit digest
per rank (:func:`all_gather_digests`); the full summaries travel only when digests differ. A final barrier agrees
that the transfer completed.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from fsdp_optim.core.layout import ShardBounds
from fsdp_optim.job import gpu_choice
from fsdp_optim.job.skeleton import fill, moved, slots, strip

__all__ = [
    "shut_down", "ProcessGroup", "Transfer", "agree", "all_gather_objects", "broadcast_from_each_rank", "check_in",
    "broadcast_object", "dist_rank_and_size", "exchange_bytes", "is_cpu_group", "post_exchange", "scatter_objects",
    "new_gloo_group", "gather_flat_tensors", "gather_objects", "group_initialized", "join_from_env", "release_group",
]  # fmt: skip

ProcessGroup = dist.ProcessGroup  # for modules that hold a group but never talk through it (job/root.py)

_STAGING_BYTES = 256 << 20  # on NCCL, staging buffers on the GPU are flushed once this many bytes are in flight


@dataclass(frozen=True)
class Transfer:
    """One state entry of one flat parameter, to be reassembled from every rank's shard."""

    numel: int  # elements of the unpadded flat full tensor
    dtype: torch.dtype
    bounds: tuple[ShardBounds, ...]  # per rank of the group; a single entry when the unit is not sharded
    local: torch.Tensor  # this rank's padded shard; read, never written


T = TypeVar("T")  # what an object collective carries

def all_gather_digests(digest: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's 64-bit ``digest`` on every rank: one small tensor all-gather (no pickling)."""
    device = _comm_device(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, mine, group=group)
    return out.tolist()


def new_gloo_group(group: dist.ProcessGroup | None, *, timeout_s: float | None = None,
                   create_within_s: float | None = None) -> dist.ProcessGroup:  # fmt: skip
    """A new gloo group over the ranks of ``group`` (a collective over the default group: every process calls it, in
    the same order), for work apart from the training loop; ``timeout_s``: its collectives' (else torch's default).
    ``create_within_s`` bounds its creation alone (met through the store, which sees a dead rank only then)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    timeout = dist.default_pg_timeout if timeout_s is None else timedelta(seconds=timeout_s)
    within = timeout if create_within_s is None else min(timeout, timedelta(seconds=create_within_s))
    made = dist.new_group(ranks=ranks, backend="gloo", timeout=within)
    if within != timeout and isinstance(made, dist.ProcessGroup):
        made.set_timeout(timeout)  # its collectives wait on peers at work: the full timeout
    return made


def release_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def join_from_env(timeout_s: float) -> None:
    """Join the default process group as ``torchrun``'s environment describes it, over gloo (``timeout_s``)."""
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))


def shut_down() -> None:
    """Destroy the default process group if a program left it up: torch's c10d threads must be joined before the
    interpreter exits, or a process can abort at exit ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def group_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


_check_ins: dict[str, int] = {}  # calls of check_in per key, in this process


def check_in(what: str, group: dist.ProcessGroup | None, timeout_s: float, *, alive: Any = None) -> None:
    """Wait on the job's store (not a collective) until every rank of ``group`` called this as often as this rank,
    or raise saying so: a rank that calls ``what`` alone gets that, not a gloo abort. ``alive``: a gloo group over
    those ranks whose barrier, posted here, fails once a rank's process is gone: said at once, not at ``timeout_s``."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    base = f"fsdp_optim/check-in/{what}/{','.join(map(str, ranks))}"
    _check_ins[base] = count = _check_ins.get(base, 0) + 1
    store, key, stop_at = dist.distributed_c10d._get_default_store(), f"{base}/{count}", time.monotonic() + timeout_s
    arrived, beat = store.add(key, 1), None if alive is None else dist.barrier(group=alive, async_op=True)
    while arrived < len(ranks) or beat is not None:
        if beat is not None and beat.is_completed():  # done, or failed: a rank's connections closed (or it hung)
            if beat.exception() is not None:
                raise RuntimeError(f"{what}: another rank was lost while this one waited for it: {beat.exception()}")
            beat = None
        elif time.monotonic() > stop_at:
            raise RuntimeError(f"{what} is a collective: every rank must call it, but only {arrived} of the "
                               f"{len(ranks)} ranks did within {timeout_s:g} s; nothing was written")  # fmt: skip
        time.sleep(0.01)
        arrived = store.add(key, 0)


def dist_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(obj: T, group: dist.ProcessGroup | None) -> list[T]:
    """Every rank's ``obj`` on every rank (one collective; under NCCL staged on :func:`object_device`)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    with _on_object_device(group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_each_rank(obj: T, group: dist.ProcessGroup | None) -> list[T]:
    """Every rank's ``obj`` on every rank, one ``broadcast_object_list`` per rank (W collectives). Its tensors travel
    as host tensors (:func:`~fsdp_optim.job.skeleton.moved`): every rank receives them on its CPU."""
    received: list[T] = []
    for src in range(dist.get_world_size(group)):
        box = [moved(obj, torch.device("cpu")) if src == dist.get_rank(group) else None]
        device = _comm_device(group)
        dist.broadcast_object_list(box, src=dist.get_global_rank(_group(group), src), group=group, device=device)
        received.append(cast(T, box[0]))  # rank src's obj
    return received


class _Receives:
    """Posted transfers, and (on NCCL) device buffers waiting to be copied to their CPU destinations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: list[Any] = []
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination slice on CPU, device buffer)
        self.staged_bytes = 0

    def buffer_for(self, destination: torch.Tensor) -> torch.Tensor:
        """Where to receive into: ``destination`` itself on CPU, else a device buffer copied back on :meth:`flush`."""
        if self.device.type == "cpu":
            return destination
        buffer = torch.empty_like(destination, device=self.device)
        self.staged.append((destination, buffer))
        self.staged_bytes += buffer.numel() * buffer.element_size()
        return buffer

    def flush(self) -> None:
        for work in self.pending:
            work.wait()
        for destination, buffer in self.staged:
            destination.copy_(buffer)
        self.pending.clear()
        self.staged.clear()
        self.staged_bytes = 0


def gather_flat_tensors(
    transfers: Sequence[Transfer], *, recipient: int | None, group: dist.ProcessGroup | None
) -> list[torch.Tensor] | None:
    """Reassemble each transfer's flat full tensor (CPU, padding dropped) on ``recipient``, a rank of ``group``;
    ``None`` assembles on every rank (one broadcast per piece instead of one message). Returns the tensors in
    ``transfers`` order where assembled, else ``None``."""
    rank = dist.get_rank(group)
    receiving = recipient is None or rank == recipient
    io = _Receives(_comm_device(group))
    outputs: list[torch.Tensor] = []
    own_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source), copied last
    for transfer in transfers:
        out = torch.empty(transfer.numel, dtype=transfer.dtype) if receiving else None
        if out is not None:
            outputs.append(out)
        if len(transfer.bounds) == 1:  # not sharded: every rank holds it all
            if out is not None:
                own_pieces.append((out, transfer.local[: transfer.numel]))
            continue
        for src, bounds in enumerate(transfer.bounds):
            if bounds.real == 0:
                continue
            if src == rank:
                piece = transfer.local[: bounds.real]
                if out is not None:
                    own_pieces.append((out[bounds.start : bounds.stop], piece))
                if recipient is None:
                    io.pending.append(_broadcast(piece.to(io.device), src, group))
                elif rank != recipient:
                    io.pending.append(dist.isend(piece.to(io.device), dst=_global(group, recipient), group=group))
            elif out is not None:
                buffer = io.buffer_for(out[bounds.start : bounds.stop])
                if recipient is None:
                    work = _broadcast(buffer, src, group)
                else:
                    work = dist.irecv(buffer, src=_global(group, src), group=group)
                io.pending.append(work)
        if io.staged_bytes > _STAGING_BYTES:
            io.flush()
    # Every receive is posted before this rank copies its own pieces, so the senders never wait on it.
    for destination, source in own_pieces:
        destination.copy_(source)
    io.flush()
    # A sender's own messages can complete while another sender dies: without this, such a rank would return
    # normally while the recipient raises. With it, a failure anywhere fails every rank (within the timeout at worst).
    dist.barrier(group=group)
    return outputs if receiving else None


def exchange_bytes(
    sends: Sequence[tuple[int, torch.Tensor]], receives: Sequence[tuple[int, int]], *, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Point to point over a CPU (gloo) group: send each ``(dst, 1-D uint8 tensor)`` and receive each ``(src,
    nbytes)`` into a new uint8 tensor (returned in ``receives`` order), matched in the order both sides list them.
    Cost: one message per item."""
    received, works = post_exchange(sends, receives, group=group)
    _ = [work.wait() for work in works if work is not None]
    return received


def post_exchange(
    sends: Sequence[tuple[int, torch.Tensor]], receives: Sequence[tuple[int, int]], *, group: dist.ProcessGroup | None
) -> tuple[list[torch.Tensor], list[Any]]:
    """:func:`exchange_bytes` without waiting: the new receive tensors, and the handles to wait on (``.wait()``)
    before using them: the receives' in ``receives`` order (None for an empty one), then the sends'. The caller
    keeps each sent tensor (contiguous) alive until every handle was waited for."""
    if not is_cpu_group(group):
        raise ValueError(f"exchanging bytes: expected a CPU (gloo) group, found backend {dist.get_backend(group)}")
    out = [torch.empty(n, dtype=torch.uint8) for _, n in receives]
    works = [dist.irecv(t, src=_global(group, src), group=group) if n else None for t, (src, n) in zip(out, receives)]
    assert all(t.is_contiguous() for _, t in sends), "a sent tensor must be contiguous: a copy would die in flight"
    return out, works + [dist.isend(t, dst=_global(group, dst), group=group) for dst, t in sends if t.numel()]


def is_cpu_group(group: dist.ProcessGroup | None) -> bool:
    return _comm_device(group).type == "cpu"  # gloo, not NCCL


# ---------------------------------------------------------------------------------------------------
# Sharded checkpoints: small objects for save/load coordination, and the scatter-on-load path.


def broadcast_object(obj: T | None, *, src: int, group: dist.ProcessGroup | None) -> T:
    """``obj`` of rank ``src`` of ``group`` on every rank: one ``broadcast_object_list``."""
    box = [obj if dist.get_rank(group) == src else None]
    dist.broadcast_object_list(box, src=_global(group, src), group=group, device=_comm_device(group))
    return cast(T, box[0])  # rank src's obj (other ranks pass None)


def gather_objects(obj: T, *, dst: int, group: dist.ProcessGroup | None) -> list[T] | None:
    """Every rank's ``obj`` on rank ``dst`` (rank order), ``None`` elsewhere: one ``gather_object``."""
    receiving = dist.get_rank(group) == dst
    out: list[Any] | None = [None] * dist.get_world_size(group) if receiving else None
    with _on_object_device(group):
        dist.gather_object(obj, out, dst=_global(group, dst), group=group)
    return out


# Error types that cross ranks as themselves; anything else arrives as RuntimeError.
_PORTABLE_ERRORS = {e.__name__: e for e in (ValueError, TypeError, NotImplementedError, FileNotFoundError, OSError)}


def agree(failure: BaseException | None, *, group: dist.ProcessGroup | None, what: str) -> None:
    """Make every rank agree on whether a step failed: one all-gather of an int (and, when some rank failed, one of
    the errors), then every rank raises or none does. A rank that failed re-raises its own ``failure``; the others
    raise the first failing rank's error with its type (a builtin or fsdp_optim's, e.g. ``ForeignOutputError``; else
    the nearest :data:`_PORTABLE_ERRORS` type, else ``RuntimeError``), its message, that rank and ``what``."""
    if not any(all_gather_digests(int(failure is not None), group)):  # all went well: no pickling, one round
        return
    mine = None
    if failure is not None:  # its own type, and the nearest portable type it is (OutputLockedError: OSError)
        kind = type(failure)
        portable = next((c.__name__ for c in kind.__mro__ if c.__name__ in _PORTABLE_ERRORS), "RuntimeError")
        mine = (kind.__module__, kind.__qualname__, str(failure), portable)
    outcomes = all_gather_objects(mine, group)
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            module, qualname, message, portable = outcome
            text = f"{message} [raised on rank {rank}; {what}]"
            fallback = _PORTABLE_ERRORS.get(portable, RuntimeError)
            try:
                error = _error_type(module, qualname, fallback)(text)
            except Exception:  # a constructor that takes more than a message
                error = fallback(text)
            raise error


def _error_type(module: str, qualname: str, fallback: type[Exception]) -> type[Exception]:
    """The exception class ``module.qualname`` when it is a builtin or fsdp_optim's own; else ``fallback``."""
    if module != "builtins" and module.partition(".")[0] != __name__.partition(".")[0]:
        return fallback
    found: object = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else fallback


def scatter_objects(
    make: Callable[[int], T] | None, own: T | None = None, *, src: int, group: dist.ProcessGroup | None
) -> T:
    """Rank ``r`` receives ``make(r)``, built on ``src`` one destination at a time; ``src`` keeps ``own``.

    Tensors of one dimension or more travel as point-to-point tensor messages (no pickling); the rest (dicts, 0-dim
    tensors, numbers) is pickled in one ``send_object_list`` per destination. So ``src`` holds one destination's
    payload at a time and each rank receives only its own. Under NCCL they arrive in, and stay in, this rank's GPU
    memory (a load puts them there anyway: no trip back through the host).
    If ``make(r)`` raises on ``src``, the later destinations are sent nothing and every rank raises
    (:func:`agree`): ``src`` its original error, the others the same error naming ``src``.

    Cost: per destination, one object message plus one message per tensor; then one small all-gather.
    """
    rank, device = dist.get_rank(group), _comm_device(group)
    if rank != src:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=_global(group, src), group=group, device=device)
        received = _receive_tensors(box[0], src, group, device) if box[0] is not None else None
        agree(None, group=group, what="scatter failed")
        return cast(T, received)  # make(rank), rebuilt: agree() raised if src sent nothing
    failure: BaseException | None = None
    if make is None:  # a caller's mistake, reported on every rank like a failing make()
        failure = TypeError(f"make: rank {src} (src) must pass a function building rank r's payload, found None")
    for dst in range(dist.get_world_size(group)):
        if dst == src:
            continue
        tensors: list[torch.Tensor] = []
        skeleton = None
        if failure is None and make is not None:
            try:
                skeleton = strip(make(dst), tensors)
            except Exception as exc:  # every rank learns of it through agree() below
                failure = exc
        dist.send_object_list([skeleton], dst=_global(group, dst), group=group, device=device)
        for tensor in tensors:
            if tensor.numel():
                dist.send(tensor.contiguous().to(device), dst=_global(group, dst), group=group)
    agree(failure, group=group, what="scatter failed")
    return cast(T, own)  # src's own payload


def _receive_tensors(skeleton: object, src: int, group: dist.ProcessGroup | None, device: torch.device) -> object:
    tensors = []
    for slot in sorted(slots(skeleton), key=lambda s: s.index):  # the order they were sent in
        buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        if buffer.numel():
            dist.recv(buffer, src=_global(group, src), group=group)
        tensors.append(buffer)
    return fill(skeleton, tensors)


def _broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> dist.Work | None:
    return dist.broadcast(tensor, src=_global(group, src), group=group, async_op=True)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("no default process group: call torch.distributed.init_process_group first")
    return world


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return dist.get_global_rank(_group(group), rank)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return object_device(group)
    return torch.device("cpu")


def _on_object_device(group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager[Any]:
    """Under NCCL, :func:`object_device` made current for a torch object collective that takes no device."""
    device = _comm_device(group)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def object_device(group: dist.ProcessGroup | None) -> torch.device:
    """The GPU an NCCL group's object collectives stage their bytes on (:func:`~fsdp_optim.job.gpu_choice.choose`:
    the group's bound device, else ``LOCAL_RANK``'s GPU); warns once where ``current_device()`` differs."""
    return gpu_choice.checked(getattr(_group(group), "bound_device_id", None))
