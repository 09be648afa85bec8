""":class:`ShardedCheckpoint`: a sharded checkpoint opened for reading (:func:`open_checkpoint`), its manifest verified,
its rank files opened lazily, each read by the one reader of its format: :class:`~.rank_file.RankFile` (formats 2 and
3, safetensors, no pickle), :class:`~.legacy.LegacyRankFile` (format 1's torch files, through the gate of
:mod:`fsdp_optim.disk.untrusted`). Never imports ``torch.distributed``.

Units are handed out one at a time, read in place; the pages touched are released whenever they exceed
``max_mapped_bytes``, so a consumer that copies what it needs keeps its resident memory near its own output plus
that bound.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.records import GroupRecord
from fsdp_optim.core.source import Source
from fsdp_optim.disk.location import Location
from fsdp_optim.disk.locations import where
from fsdp_optim.formats.sharded.legacy import LegacyRankFile
from fsdp_optim.formats.sharded.locate import checkpoint_location, manifest_at
from fsdp_optim.formats.sharded.manifest import Manifest, manifest_source
from fsdp_optim.formats.sharded.rank_file import RankFile
from fsdp_optim.formats.sharded.segments import file_layout, manifest_shards
from fsdp_optim.formats.sharded.sources import ByteSource, held_readers
from fsdp_optim.formats.sharded.training import optimizer_flats, weights_flats

__all__ = [
    "DEFAULT_MAPPED_BYTES",
    "ShardedCheckpoint",
    "open_checkpoint",
]

DEFAULT_MAPPED_BYTES = 64 << 20


def open_checkpoint(
    path: str | os.PathLike[str] | Location, *, lazy: bool = True, max_mapped_bytes: int = DEFAULT_MAPPED_BYTES
) -> ShardedCheckpoint:
    """The sharded checkpoint at ``path`` (its directory or manifest, a URL, a :class:`Location`) opened for reading:
    the one way every reader opens one (loads, the memory tier's restore, verification, the offline tools).

    ``lazy`` (the default): no rank file is opened yet, each reader opens those it reads (a job's rank its own at
    the saved layout); ``lazy=False`` opens and checks every rank file first (the offline tools, which read them
    all). ``max_mapped_bytes``: see :class:`ShardedCheckpoint`."""
    return ShardedCheckpoint(where(path), lazy=lazy, max_mapped_bytes=max_mapped_bytes)


class ShardedCheckpoint:
    """A sharded checkpoint directory opened for reading: its verified manifest and lazy rank files.

    Read one unit at a time with :meth:`unit` (or :meth:`copy_range`), copy what you keep, and call
    :meth:`trim` between units: mapped pages are dropped once they exceed ``max_mapped_bytes``. In
    formats 2 and 3, :meth:`copy_range` reads only the chunks of the rank files that the range touches,
    verifying each before it copies from it straight into the destination.
    """

    def __init__(
        self,
        place: Location,
        *,
        max_mapped_bytes: int = DEFAULT_MAPPED_BYTES,
        lazy: bool = False,
    ) -> None:
        # ``place``: resolved once by the caller (:func:`open_checkpoint`); every read below goes through it
        self.directory: Location = checkpoint_location(place)
        self.manifest = manifest_at(place)  # (a directory, its manifest file, or a store's prefix or manifest)
        # A capability, not a backend: where the checkpoint's objects are local files, they are mapped in place
        # (zero-copy views; format 1's torch files loaded from them); elsewhere they are read by byte ranges.
        mapped = self.directory.local_path()
        if mapped is None and self.manifest.version < 2:
            raise ValueError(
                f"{place}: a format-{self.manifest.version} checkpoint (torch files), which is read from a local "
                "directory only; copy it to local disk, or rewrite it with `fsdp-optim reshard` first"
            )
        if not self.manifest.files:
            raise ValueError(f"{place}: the manifest lists no rank files (a layout file, not a checkpoint)")
        self.max_mapped_bytes = max_mapped_bytes
        self.shards = ShardIndex.of(self.manifest.flat_params)  # per-unit ints: ranks and ranges by arithmetic
        # Format 3: where each shard lies, the same in every rank file, from the units (once, not per file).
        shards = manifest_shards(self.manifest.flat_params, self.shards) if self.manifest.version >= 3 else []
        layout = file_layout(shards)
        self.layout = layout
        self._files: dict[int, RankFile | LegacyRankFile] = {
            f.rank: RankFile(self.directory, f, self.manifest, layout, mapped=mapped)
            if self.manifest.version >= 2 or mapped is None
            else LegacyRankFile(mapped, f, self.manifest, self.shards)
            for f in self.manifest.files
        }
        self._mapped = 0  # bytes read in place since the last trim
        if not lazy:
            self.open_all()

    def open_all(self) -> None:
        """Map every rank file and check its header and size against the manifest (no unit is read yet).

        Done before anything is planned or allocated, unless ``lazy=True``: the manifest's shapes then
        cannot make a reader allocate more than the rank files really hold. A job opens lazily: its own
        file at the saved layout (:meth:`load_rank`), else the files its plan reads (:meth:`open_ranks`).
        """
        self.open_ranks(self._files)

    def open_ranks(self, ranks: Iterable[int]) -> None:
        """:meth:`open_all` for rank files ``ranks`` only: those a plan reads (``core.plan.saved_ranks``)."""
        for rank in ranks:
            self._files[rank].open()

    def provide(self, files: Mapping[int, Callable[[], ByteSource] | None]) -> None:
        """Read rank ``r``'s file from what ``files[r]()`` opens (its bytes as the caller holds them, e.g. received
        from a peer: :class:`~fsdp_optim.formats.sharded.sources.HeldSource`) rather than from the directory; its
        header is checked against the manifest when it is opened, and every chunk read is verified, as on disk.
        ``None`` reads it from the directory again."""
        for rank, file in files.items():
            f = self._files[rank]
            if not isinstance(f, RankFile):
                raise TypeError(f"{self.directory}: a format-{self.manifest.version} checkpoint; provided files are "
                                "read for formats 2 and 3 only")  # fmt: skip
            f.release()
            f.provided = file

    @contextmanager
    def fetched_ahead(self, spans: Callable[[], Sequence[Any]]) -> Iterator[dict[str, Callable[[], bytes]]]:
        """Within the block, the rank files are read from the byte ranges ``spans()`` lists (those a load reads, in
        order of use: ``byte_ranges.Span``) as :meth:`Location.prefetch <fsdp_optim.disk.location.Location.prefetch>`
        fetches them ahead (a store's ranged reads, a bounded window ahead; node memory's pieces from peers), each
        verified as a file's bytes are; yields thunks of the side files among them (``{name: bytes}``; {} where the
        location fetches nothing ahead: a local directory maps its files). After it, they are read as before."""
        with self.directory.prefetch(spans) as held:
            if held is None:
                yield {}
                return
            files, sides = held_readers(self.manifest.files, lambda name: self.directory / name, held)
            self.provide(files)
            try:
                yield sides
            finally:
                self.provide(dict.fromkeys(files))

    def source(self) -> Source:
        """This checkpoint's optimizer state as a planning source (reads go through :meth:`copy_range`); a whole
        checkpoint's weights are left out (:meth:`weights_source`)."""
        manifest = replace(self.manifest, flat_params=optimizer_flats(self.manifest.flat_params))
        return self.whole_source(manifest)

    def weights_source(self) -> Source:
        """A whole checkpoint's model weights as a planning source: one group of every unit, one state key
        (:data:`~fsdp_optim.core.records.WEIGHTS_KEY`). ``ValueError`` for an optimizer-only checkpoint."""
        if self.manifest.training is None:
            raise ValueError(
                f"{self.directory}: an optimizer-only checkpoint (no model weights; written by "
                "save_sharded_optim_state); load it with load_sharded_optim_state, or save with save_checkpoint"
            )
        flats = weights_flats(self.manifest.flat_params)
        groups = (GroupRecord({}, tuple(range(len(flats)))),)
        manifest = replace(self.manifest, flat_params=flats, groups=groups, optimizer="model weights")
        return self.whole_source(manifest)

    def whole_source(self, manifest: Manifest | None = None) -> Source:
        """Every state key of every unit (a whole checkpoint's weights beside its optimizer state) as one planning
        source, in the optimizer's groups (a frozen unit's weights in none): what an offline reshard re-cuts.
        (``manifest``: a part of it, as :meth:`source` and :meth:`weights_source` ask.)"""
        per_rank = any(f.per_rank for f in self.manifest.flat_params)
        return manifest_source(manifest or self.manifest, str(self.directory), self.copy_range,
                               self.reader if per_rank else None)  # fmt: skip

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.release()
        self._mapped = 0

    def unit(self, rank: int, flat_index: int) -> Mapping[str, Any]:
        """Rank ``rank``'s verified entries for flat parameter ``flat_index`` (file-backed: copy what you keep)."""
        entries = self._files[self.file_rank(rank, flat_index)].unit(flat_index)
        self._mapped += sum(v.numel() * v.element_size() for v in entries.values() if torch.is_tensor(v))
        return entries

    def file_rank(self, rank: int, flat_index: int) -> int:
        # A unit that is not sharded is stored whole in every rank file; read rank 0's, unless every
        # rank holds its own copy (per-rank units, MoE experts).
        flat = self.manifest.flat_params[flat_index]
        return rank if flat.world_size > 1 or flat.per_rank else 0

    def rank_file(self, rank: int) -> RankFile | None:
        """Rank ``rank``'s file of a format-2 or 3 checkpoint (not opened yet), ``None`` for format 1's torch files."""
        f = self._files[rank]
        return f if isinstance(f, RankFile) else None

    def load_rank(self, rank: int) -> dict[int, dict[str, Any]]:
        """Every unit of one rank file, read into memory (not mapped) and verified."""
        f = self._files[rank]
        try:
            return f.load_all()
        finally:
            f.release()

    def reader(self, rank: int) -> Callable[[int, str, int, int, torch.Tensor], None]:
        """:meth:`copy_range`, except that per-rank units are read from rank ``rank``'s own file."""

        def read(flat_index: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
            for r, lo, hi, at in self.pieces(rank, flat_index, start, stop):
                self._copy(r, flat_index, key, lo, hi, out[at : at + hi - lo])

        return read

    def copy_range(self, flat_index: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, stop)`` of flat parameter ``flat_index``'s full state ``key`` into ``out``."""
        for rank, lo, hi, at in self._shared_pieces(flat_index, start, stop):
            self._copy(rank, flat_index, key, lo, hi, out[at : at + hi - lo])

    def pieces(self, rank: int, flat_index: int, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """What :meth:`reader` of ``rank`` reads for elements ``[start, stop)`` of ``flat_index``: ``(saved rank, lo,
        hi, at)``, elements ``[lo, hi)`` of that rank's shard into offset ``at`` of the output (:meth:`file_rank`
        names the file holding it)."""
        if self.manifest.flat_params[flat_index].per_rank:
            yield rank, start, stop, 0
        else:
            yield from self._shared_pieces(flat_index, start, stop)

    def _shared_pieces(self, flat_index: int, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        chunk = self.shards.shard_numel(flat_index)
        for rank, lo, hi in self.shards.pieces(flat_index, start, stop):  # only the ranks holding [start, stop)
            yield rank, lo - rank * chunk, hi - rank * chunk, lo - start

    def _copy(self, rank: int, flat_index: int, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of rank ``rank``'s shard of ``key`` into ``out``."""
        out.copy_(self._files[self.file_rank(rank, flat_index)].view(flat_index, key, start, stop))
        self._mapped += (stop - start) * out.element_size()

    def read_rows(self, tensor: str, ranks: range, out: torch.Tensor) -> None:
        """Format 3: tensor ``tensor`` of rank files ``ranks`` read whole into the rows of ``out``, each verified."""
        expected = (len(ranks), self.layout[1].get(tensor))
        if self.manifest.version < 3 or tuple(out.shape) != expected:
            raise ValueError(
                f"{self.directory}: rows of tensor '{tensor}' of rank files {ranks.start}..{ranks.stop - 1}: "
                f"expected a format-3 checkpoint and rows {expected}, found format {self.manifest.version} and "
                f"rows {tuple(out.shape)}"
            )
        for row, rank in enumerate(ranks):
            f = self._files[rank]
            assert isinstance(f, RankFile), f"{f.path}: format {self.manifest.version}"
            f.read_whole(tensor, out[row])
            f.release()

    def trim(self) -> None:
        """Drop the pages touched since the last drop if they exceed ``max_mapped_bytes``."""
        if self._mapped > self.max_mapped_bytes:
            for f in self._files.values():
                f.drop()  # (formats 2, 3: the mappings kept, their headers checked; their pages dropped)
            self._mapped = 0
