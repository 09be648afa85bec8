"""Why an object store's save is safe where there is no rename and no lock: the protocol that
:class:`~fsdp_optim.disk.location.Location` writes once, as the default of every backend's save steps.

The protocol (one writer per save; any number of writers of one prefix can race and never mix)::

    begin_save (rank 0)       list the prefix: foreign objects refused (unless overwrite), the commit object's etag
                              noted, and the names the committed checkpoint lists (the commit replaces them)
    stage/publish (each rank) its files written under names unique to the save into local staging, uploaded
                              (multipart above the filesystem's block size), each removed locally once up
    commit_manifest (rank 0)  the commit object put with If-None-Match: * (none found) or If-Match: <etag found>:
                              412 -> ConcurrentCommitError, and every rank discards what it uploaded
    finish_save (rank 0)      objects the format claims that the new manifest does not list and that are older than
                              this save's own files: what replaced checkpoints and killed or losing writers left.
                              A foreign object is never deleted.

Why the age rule is safe: a writer that began before this save's first upload read the old manifest's etag (or
none), so its commit is bound to fail with 412 after this commit; a writer that begins later uploads later. Only a
doomed writer's files can be older, and a live writer's never are.

``StoreSaving`` and ``StoreBegun`` are the names this protocol's classes had when it was written apart from
``Location``; they stay for code that names them.
"""

from __future__ import annotations

from fsdp_optim.disk.location import Begun, Location

__all__ = ["StoreBegun", "StoreSaving"]

StoreSaving = Location  # every backend's save steps are the store protocol unless it overrides a hook
StoreBegun = Begun
