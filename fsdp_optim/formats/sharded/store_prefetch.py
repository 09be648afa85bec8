"""A load reading a checkpoint's files from byte ranges its location fetched ahead (:meth:`Location.prefetch
<fsdp_optim.disk.location.Location.prefetch>`: an object store's ranged reads, a bounded window ahead of the load;
a local directory maps its files instead and fetches nothing). Every range becomes part of a
:class:`~fsdp_optim.formats.sharded.sources.HeldSource` (:func:`~fsdp_optim.formats.sharded.sources.held_readers`),
so every byte is verified as a file's are before it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from fsdp_optim.formats.sharded.byte_ranges import Span
from fsdp_optim.formats.sharded.reader import ShardedCheckpoint
from fsdp_optim.formats.sharded.sources import held_readers

__all__ = ["fetched_ahead"]


@contextmanager
def fetched_ahead(
    ckpt: ShardedCheckpoint, spans: Callable[[], Sequence[Span]]
) -> Iterator[dict[str, Callable[[], bytes]]]:
    """Within the block, ``ckpt`` reads its rank files from ``spans()`` (the ranges its load reads, in order of use)
    as its location fetches them ahead; yields thunks of the side files among them (``{name: bytes}``; {} where the
    location fetches nothing ahead). After it, the rank files are read from the location again."""
    location = ckpt.directory
    with location.prefetch(spans) as held:
        if held is None:
            yield {}
            return
        files, sides = held_readers(ckpt.manifest.files, lambda name: location / name, held)
        ckpt.provide(files)
        try:
            yield sides
        finally:
            ckpt.provide(dict.fromkeys(files))
