"""The errors of the :class:`~fsdp_optim.disk.location.Location` interface, whatever the backend.

They live apart from every backend, so that code handling them (a verification, a step listing, a save's commit)
imports no backend: a purely local save never loads the fsspec one.
"""

from __future__ import annotations

__all__ = ["CommitOutcomeUnknown", "ConcurrentCommitError", "StoreUnavailable"]


class ConcurrentCommitError(FileExistsError):
    """Another writer committed a manifest under the same prefix since this save began; this save committed nothing."""


class StoreUnavailable(OSError):
    """A request that kept failing after its retries (5xx, SlowDown, reset connections, short bodies): the store did
    not answer, which says nothing about the checkpoint in it (a verification reports it, never as damage)."""


class CommitOutcomeUnknown(OSError):
    """A commit whose put failed without an answer (its responses lost) and whose object could not be read back
    after: the manifest may be in place, so the files it lists are kept (the next save removes them if not)."""
