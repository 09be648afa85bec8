"""A rank file of a re-cut written one shard at a time: :func:`streamed_parts` is what
:func:`~.writer.write_shard_file` writes (the same bytes as for the rank's whole state: the same
:func:`~.segments.file_layout`, metadata and chunk checksums), each ``(unit, state key)`` shard cut only when the
writer reaches it (:func:`~fsdp_optim.core.execute.cut_rank` of :func:`~fsdp_optim.core.execute.restrict`) and
dropped once written: memory holds one shard of one unit, never the rank's whole state::

    output rank 1, tensors float32 = [u0/exp_avg | u0/exp_avg_sq | u2/exp_avg ...], bfloat16 = [u0/@param ...]
    each | ... | cut from the source's ranges, hashed into its chunks, written, released
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch

from fsdp_optim.core.execute import cut_rank, restrict
from fsdp_optim.core.intervals import ShardIndex
from fsdp_optim.core.source import Plan
from fsdp_optim.formats.sharded.manifest import Manifest
from fsdp_optim.formats.sharded.segments import file_layout, manifest_shards
from fsdp_optim.formats.sharded.writer import RankParts

__all__ = ["streamed_parts"]


class _Shards(Sequence[torch.Tensor]):
    """The shards of one tensor of output rank ``rank``, each cut when asked for (``after`` runs after each)."""

    def __init__(self, the_plan: Plan, rank: int, keys: list[tuple[int, str]], after: Callable[[], None]) -> None:
        self.plan, self.rank, self.keys, self.after = the_plan, rank, keys, after

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        flat, key = self.keys[i]
        shard = cut_rank(restrict(self.plan, flat, key), self.rank)[flat][key]
        self.after()
        return shard

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[k] for k in range(len(self)))


def streamed_parts(the_plan: Plan, final: Manifest, rank: int, *, after_shard: Callable[[], None]) -> RankParts:
    """Output rank ``rank`` of ``final`` (``the_plan``'s target), each shard cut when the writer asks for it (module
    docstring); ``after_shard`` runs after each shard is cut (to release the source's mappings)."""
    where, sizes = file_layout(manifest_shards(final.flat_params, ShardIndex.of(final.flat_params)))
    keys: dict[str, list[tuple[int, str]]] = {name: [] for name in sizes}
    for (flat, key), (tensor, _, _) in sorted(where.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        keys[tensor].append((flat, key))
    return RankParts({name: _Shards(the_plan, rank, keys[name], after_shard) for name in sizes}, sizes)
