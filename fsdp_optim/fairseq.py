"""The public face of the fairseq / metaseq adapter (the format lives in :mod:`fsdp_optim.formats.fairseq`,
the entry points in :mod:`fsdp_optim.offline.fairseq`).

``consolidate_shards(path, out)`` and ``reshard_shards(path, out_prefix, world_size)`` work on a shard set
(``...-shard<r>.pt`` files, one per rank, as fairseq's and metaseq's ``use_sharded_state`` write them);
``ShardSet`` reads one; ``DATA_ONLY_GLOBALS`` is what such a file may name besides tensors.
"""

from fsdp_optim.formats.fairseq.files import DATA_ONLY_GLOBALS, METADATA_KEYS, OPTIM_KEY
from fsdp_optim.formats.fairseq.paths import is_shard_set
from fsdp_optim.formats.fairseq.recut import reshard_shards
from fsdp_optim.offline.fairseq import ShardSet, consolidate_shards

__all__ = [
    "DATA_ONLY_GLOBALS",
    "METADATA_KEYS",
    "OPTIM_KEY",
    "ShardSet",
    "consolidate_shards",
    "is_shard_set",
    "reshard_shards",
]
