"""The memory tier as a :class:`~fsdp_optim.disk.location.Location`: :class:`NodeMemory`, one step as this rank's
node holds it in host memory (tmpfs), its peers' pieces arriving through the process group.

To every reader and writer it is a local directory (the step directory, mapped in place). It differs in two of the
methods the save and the load call on every backend: its writer's commit is the seal (:meth:`NodeMemory.seal`), and
its prefetch receives the byte ranges this node lacks from the ranks whose node holds them
(:meth:`NodeMemory.prefetch`); the steps are :mod:`fsdp_optim.job.memory`'s. Every collective here runs on the group
the :class:`NodeMemory` was made with (the checkpoint group of a save, the restore's group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdp_optim.core.memory_plan import Fetch, node_ranks, replica_peers, sources_of
from fsdp_optim.disk.atomic import atomic_write
from fsdp_optim.disk.local_directory import LocalDirectory, RenameWriter
from fsdp_optim.disk.save import Begun, SaveRules
from fsdp_optim.formats.sharded.manifest import MANIFEST_NAME, Manifest
from fsdp_optim.formats.sharded.manifest_json import manifest_from_json
from fsdp_optim.formats.sharded.memory_tier import Marker, prune_node, write_marker
from fsdp_optim.formats.sharded.sources import Held, ReceivedPiece
from fsdp_optim.job.agreed import step
from fsdp_optim.job.transport import (
    ProcessGroup,
    broadcast_object,
    dist_rank_and_size,
    exchange_bytes,
    post_exchange,
)

__all__ = ["MemoryTierDamaged", "MemoryWriter", "NodeMemory", "Sealing", "file_bytes", "step_files"]


class MemoryTierDamaged(ValueError):
    """The step chosen in the memory tiers could not be read (its bytes failed a check, a file was missing or a
    transfer failed); raised on every rank with nothing changed: durable storage is the way back."""


@dataclass(frozen=True)
class Sealing:
    """What :meth:`NodeMemory.seal` needs to know of a save: its step and id, every rank's node, this rank's node,
    how many other nodes keep a copy of each rank's files, and how many complete steps a node keeps."""

    step: int
    save_id: str
    nodes: Sequence[str]
    node: str
    replicas: int
    keep: int


class NodeMemory(LocalDirectory):
    """Step directory ``path`` of this rank's node, read and committed with the ranks of ``group``. ``sealing``: a
    save's; ``fetches``: a restore's plan of the byte ranges sent between ranks (or a function returning it when the
    prefetch begins)."""

    def __init__(
        self,
        path: str | Path,
        group: ProcessGroup | None,
        *,
        sealing: Sealing | None = None,
        fetches: Sequence[Fetch] | Callable[[], Sequence[Fetch]] = (),
    ) -> None:  # noqa: D107
        super().__init__(path)
        self.group, self.sealing = group, sealing
        self._fetches = fetches if callable(fetches) else partial(tuple, fetches)

    def __repr__(self) -> str:
        return f"NodeMemory({str(self.path)!r})"

    # -- reading: the pieces this node lacks, received -------------------------------------------------------

    @contextmanager
    def prefetch(self, spans: Callable[[], Sequence[Any]]) -> Iterator[dict[str, list[Held]]]:  # noqa: ARG002
        """Every transfer of ``fetches`` posted at once (``spans`` is not needed: the plan covers every rank's);
        yields this rank's received pieces by file name, each waited for at its first use. Leaving the block waits
        for every transfer, so nothing is left in flight; a failed transfer then raises :class:`MemoryTierDamaged`
        (unless the block raised first: its error is kept). A file of this node that cannot be read is sent as
        zeros, which its receivers refuse by checksum (no receiver waits for ever), and raises here."""
        rank, _ = dist_rank_and_size(self.group)
        fetches = self._fetches()
        sends, unreadable = sends_of(fetches, rank, self.path)
        mine = [f for f in fetches if f.dst == rank]
        received, works = post_exchange(sends, [(f.src, f.nbytes) for f in mine], group=self.group)
        inflight = _InFlight(works, [t for _, t in sends])
        try:
            if unreadable is not None:
                raise MemoryTierDamaged(unreadable)
            pieces: dict[str, list[Held]] = {}
            for i, (fetch, data) in enumerate(zip(mine, received, strict=True)):
                pieces.setdefault(fetch.file, []).append(ReceivedPiece(fetch.start, data, partial(inflight.wait, i)))
            yield pieces
        except BaseException:
            inflight.finish(quiet=True)
            raise
        inflight.finish()

    def spread_manifest(self, src: int, nodes: Sequence[str], *, what: str) -> None:
        """A restore's step 2 (collective): the manifest from rank ``src`` (its node holds the step) to every rank;
        the first rank of each node lacking it writes it. Agreed."""
        rank, _ = dist_rank_and_size(self.group)
        manifest = self.path / MANIFEST_NAME
        data = broadcast_object(manifest.read_bytes() if rank == src else None, src=src, group=self.group)
        with step(what, group=self.group):
            if node_ranks(nodes)[nodes[rank]][0] == rank and not manifest.is_file():
                self.path.mkdir(parents=True, exist_ok=True)
                _write_file(manifest, data)

    # -- committing: replicas, then the node's marker ---------------------------------------------------------

    def writer(self, rules: SaveRules) -> MemoryWriter:
        return MemoryWriter(self, rules)

    def seal(self, save: Sealing, manifest_bytes: bytes | None) -> Path:
        """The seal, steps 2 and 3 of a save (:mod:`fsdp_optim.job.memory`), once every rank's files are written here
        (``manifest_bytes``: rank 0's). This node's step directory."""
        rank, _ = dist_rank_and_size(self.group)
        what = f"the memory-tier save of step {save.step} failed, nothing was marked"
        here = self.path / MANIFEST_NAME
        data = broadcast_object(manifest_bytes if rank == 0 else None, src=0, group=self.group)
        manifest = manifest_from_json(data, source=f"the manifest of memory-tier step {save.step}")
        peers = replica_peers(save.nodes, save.replicas)
        with step(what, group=self.group):  # every rank learns of a failure before any replica moves
            if not here.exists():
                _write_file(here, data)
            own = [self.path / name for name, _ in step_files(manifest, rank)]
            sends = [(dst, file_bytes(path)) for dst in peers[rank] for path in own]
        expected = [(src, name, n) for src in sources_of(peers, rank) for name, n in step_files(manifest, src)]
        received = exchange_bytes(sends, [(src, n) for src, _, n in expected], group=self.group)
        with step(what, group=self.group):
            for (_, name, _), data_in in zip(expected, received, strict=True):
                _write_file(self.path / name, data_in)
        if node_ranks(save.nodes)[save.node][0] == rank:
            write_marker(self.path, _marker(save, manifest, peers))
            prune_node(self.path.parent, keep=save.keep)  # the node's directory
        return self.path


class MemoryWriter(RenameWriter):
    """The memory tier's save: a local directory's (nothing begun, locked or replaced), whose commit is the seal."""

    location: NodeMemory

    def commit(self, begun: Begun | None, data: bytes | None) -> None:  # noqa: ARG002 - never begun
        """Every rank: the step sealed, ``data`` (the manifest) from rank 0."""
        if self.location.sealing is None:
            raise TypeError(f"{self.location}: opened for a restore (no sealing given): it cannot commit a save")
        self.location.seal(self.location.sealing, data)


def _marker(save: Sealing, manifest: Manifest, peers: Sequence[Sequence[int]]) -> Marker:
    """This node's marker: every file of the step, and those of its own ranks and of the ranks it keeps copies of."""
    here = set(node_ranks(save.nodes)[save.node])
    ranks = here | {src for src, targets in enumerate(peers) if here & set(targets)}
    files = sorted(f for r in range(manifest.world_size) for f in step_files(manifest, r))
    held = sorted(name for r in ranks for name, _ in step_files(manifest, r))
    return Marker(save.step, save.save_id, manifest.world_size, save.node, tuple(files), tuple(held))


class _InFlight:
    """Transfers posted (:func:`~fsdp_optim.job.transport.post_exchange`'s handles), and the sent tensors, kept
    alive until :meth:`finish`."""

    def __init__(self, works: list[Any], kept: Sequence[Any]) -> None:
        self._works, self._kept = works, list(kept)

    def wait(self, i: int) -> None:
        """Wait for handle ``i`` (receive ``i``), once."""
        work, self._works[i] = self._works[i], None
        if work is not None:
            work.wait()

    def finish(self, *, quiet: bool = False) -> None:
        """Wait for every transfer; then, unless ``quiet``, raise the first error (a peer gone) as
        :class:`MemoryTierDamaged`. Nothing is left in flight either way."""
        errors = []
        for i in range(len(self._works)):
            try:
                self.wait(i)
            except Exception as exc:
                errors.append(exc)
        self._kept = []
        if errors and not quiet:
            raise MemoryTierDamaged(f"a transfer of the step's bytes failed: {errors[0]}") from errors[0]


def sends_of(fetches: Sequence[Fetch], rank: int, directory: Path) -> tuple[list[tuple[int, torch.Tensor]], str | None]:
    """``(dst, bytes)`` of the fetches ``rank`` sends, in plan order: views of its node's files (mapped once each,
    copy on write: never written back), not copies; and what went wrong, if anything. A file that cannot be read
    is sent as zeros (its receivers refuse them by checksum) so that no receiver waits for ever."""
    mapped: dict[str, torch.Tensor] = {}
    out, failure = [], None
    for f in fetches:
        if f.src != rank:
            continue
        if f.file not in mapped:
            try:
                mapped[f.file] = file_bytes(directory / f.file)
            except OSError as exc:
                mapped[f.file], failure = torch.empty(0, dtype=torch.uint8), failure or f"{exc}"
        data = mapped[f.file]
        if data.numel() < f.stop:
            failure = failure or f"{directory / f.file}: {data.numel()} bytes, expected at least {f.stop}"
            out.append((f.dst, torch.zeros(f.nbytes, dtype=torch.uint8)))
        else:
            out.append((f.dst, data[f.start : f.stop]))
    return out, failure


def step_files(manifest: Manifest, rank: int) -> list[tuple[str, int]]:
    """Saved rank ``rank``'s files of a whole checkpoint: ``[(rank file, bytes), (side file, bytes)]``."""
    out = [(f.file, f.nbytes) for f in manifest.files if f.rank == rank]
    if manifest.training is not None:
        side = manifest.training.side_file(rank)
        out.append((side.file, side.nbytes))
    return out


def file_bytes(path: Path) -> torch.Tensor:
    """A file's bytes as a 1-D uint8 tensor, mapped (copy on write: never written back), not read into memory."""
    if path.stat().st_size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))


def _write_file(path: Path, data: bytes | torch.Tensor) -> None:
    """Write ``path`` atomically from bytes or a uint8 tensor (no copy of the tensor's bytes)."""
    view = data.numpy().data if isinstance(data, torch.Tensor) else data  # a memoryview: no copy
    atomic_write(path, lambda f: f.write(view))
