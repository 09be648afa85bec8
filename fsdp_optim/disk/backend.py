"""A new storage backend in one small class: :class:`ObjectBackend`.

A backend implements the eight byte-level methods of :class:`~fsdp_optim.disk.byte_io.ByteIO`; everything else a
:class:`~fsdp_optim.disk.location.Location` does (naming, sizes, ranged reads, the save steps) is written once, above
it. It may override ``read_range`` or ``download`` where it can do better; its ``commit`` may check an object's
version with :meth:`ObjectBackend.etag`. Register it for a URL scheme with
:func:`~fsdp_optim.disk.locations.register_backend`, or pass an instance wherever a path is taken.
"""

from __future__ import annotations

from fsdp_optim.disk.byte_io import listed_etag
from fsdp_optim.disk.location import Location, identity
from fsdp_optim.disk.store_policy import RetryPolicy

__all__ = ["ObjectBackend"]


class ObjectBackend(Location):
    """The base of a backend the package has no code for (the module docstring), known by its name."""

    policy = RetryPolicy(float("inf"), attempts=1)  # a backend retries inside its own methods, if it needs to

    def etag(self, name: str) -> str | None:
        """Object ``name``'s version as :meth:`listing` gives it (:func:`~fsdp_optim.disk.byte_io.listed_etag`: its
        etag, else its size and time), ``None`` when there is none: what ``commit`` compares ``replaces`` with."""
        return listed_etag(self.listing().get(name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and identity(other) == identity(self)

    def __hash__(self) -> int:
        return hash(identity(self))
