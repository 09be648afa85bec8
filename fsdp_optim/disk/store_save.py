"""How a save commits to an object store, where there is no rename and no lock: the save half of
:class:`~fsdp_optim.disk.storage.ObjectStore`'s :class:`~fsdp_optim.disk.location.Location`.

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
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_optim.disk.location import Begun, Location, SaveRules, Staging
from fsdp_optim.disk.locks import ForeignOutputError

__all__ = ["StoreBegun", "StoreSaving"]


@dataclass(frozen=True)
class StoreBegun(Begun):
    """What rank 0 found when a save began: the commit object's etag (``None``: none there) and the names the
    checkpoint there lists (removed once this save's manifest replaced it)."""

    rules: SaveRules
    replaces: str | None
    replaced_files: frozenset[str] = frozenset()


class StoreSaving(Location):
    """The save protocol of a store, on its object operations (:class:`~fsdp_optim.disk.storage.ObjectStore`)."""

    @abstractmethod
    def etag(self, name: str) -> str | None: ...

    @abstractmethod
    def upload(self, local: Path, name: str) -> None: ...

    @abstractmethod
    def commit(self, name: str, data: bytes, *, replaces: str | None) -> None: ...

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None: ...

    def begin_save(self, rules: SaveRules, *, purpose: str, overwrite: bool) -> Begun:  # noqa: ARG002
        """Refuse a prefix holding objects that are not the format's (unless ``overwrite``: they are then left
        alone, never deleted) or a commit object that is not the format's; note its etag for the commit."""
        listing = self.listing()
        foreign = sorted(n for n in listing if n not in rules.known and not rules.claims.deletable(n))
        if foreign and not overwrite:
            raise ForeignOutputError(
                f"{self}: holds objects that are not an fsdp_optim checkpoint's ({', '.join(foreign[:5])}"
                f"{'...' if len(foreign) > 5 else ''}); write elsewhere, or pass overwrite=True to write beside them "
                "(they are never deleted)"
            )
        replaced: frozenset[str] = frozenset()
        etag = self.etag(rules.commit_name)
        if rules.commit_name in listing:
            try:
                replaced = rules.listed(self)
            except (ValueError, OSError) as exc:
                raise ForeignOutputError(
                    f"{self}: its {rules.commit_name} is not an fsdp_optim manifest ({exc}); the commit would replace "
                    "it, so it is refused even with overwrite (move or delete it yourself)"
                ) from None
        return StoreBegun(rules, etag, replaced)

    def stage(self, save_id: str, rank: int) -> Staging:
        """A local directory in ``$TMPDIR`` (removed by :meth:`unstage`); nothing fsynced there."""
        return Staging(Path(tempfile.mkdtemp(prefix=f"fsdp_optim-{save_id[:8]}-rank{rank}-")), durable=False)

    def publish(self, staging: Staging, names: Iterable[str]) -> None:
        for name in names:
            self.upload(staging.path / name, name)
            (staging.path / name).unlink()

    def discard(self, names: Iterable[str]) -> None:
        """Remove what this rank uploaded (best effort: the next writer's :meth:`finish_save` removes the rest)."""
        try:
            self.delete(names)
        except OSError as exc:
            warnings.warn(f"{self}: could not remove this failed save's files ({exc}); the next save removes them",
                          stacklevel=2)  # fmt: skip

    def unstage(self, staging: Staging) -> None:
        shutil.rmtree(staging.path, ignore_errors=True)

    def commit_manifest(self, rules: SaveRules, begun: Begun | None, data: bytes) -> None:
        if not isinstance(begun, StoreBegun):
            raise TypeError(f"{self}: a save not begun here ({begun!r})")
        self.commit(rules.commit_name, data, replaces=begun.replaces)

    def finish_save(self, begun: Begun, *, failed: bool, keep: frozenset[str] = frozenset()) -> None:
        if not isinstance(begun, StoreBegun):
            raise TypeError(f"{self}: a save begun at another location ({begun!r})")
        if not failed:
            self.tidy(begun, keep)

    def tidy(self, begun: StoreBegun, keep: frozenset[str]) -> list[str]:
        """After a commit: remove the files of the checkpoint it replaced, and the claimed objects the new manifest
        does not list (``keep``) that are older than its own files. Returns the names removed; a failure only warns
        (the next save retries)."""
        try:
            listing = self.listing()
            times = [listing[n].mtime for n in keep if n in listing]
            oldest = min((t for t in times if t is not None), default=float("-inf"))
            stale = [
                n
                for n, o in listing.items()
                if begun.rules.claims.deletable(n)
                and n not in keep
                and (n in begun.replaced_files or (o.mtime is not None and o.mtime < oldest))
            ]
            self.delete(stale)
            return stale
        except OSError as exc:
            warnings.warn(f"{self}: could not remove the files of replaced or failed saves ({exc}); the next save "
                          "will", stacklevel=2)  # fmt: skip
            return []
