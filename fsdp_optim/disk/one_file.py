"""One local output file as a save of one object through the one driver (:func:`fsdp_optim.disk.save.saving`):
:class:`FileWriter`, and :func:`write_stream` / :func:`write_file` (one process fills the file)::

    begin    check_not_input; the file's lock; a killed writer's temporary file removed (by its journaled tag); an
             existing file refused unless ``overwrite``; the save journaled (file, tag)
    stage    the tagged temporary file beside the output, created exclusively: the bytes are written there
    commit   ``data`` (a header over its planned room; none for a stream) written at offset 0, fsync, rename;
             finish: the lock released (abort: the temporary file removed first)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from fsdp_optim.disk.atomic import fsync_dir, save_into
from fsdp_optim.disk.journal import JournalEntry
from fsdp_optim.disk.local_directory import LocalDirectory
from fsdp_optim.disk.locks import OutputLock, check_not_input, lock_output, sweep_temporaries
from fsdp_optim.disk.save import Begun, Staging, Writer, saving
from fsdp_optim.disk.untrusted import describe_file

__all__ = ["FileWriter", "write_file", "write_stream"]


class FileWriter(Writer):
    """The save of the one file ``path`` (the module docstring); ``inputs``: paths it must not be."""

    def __init__(self, path: str | os.PathLike[str], *, inputs: Iterable[Any] = ()) -> None:  # noqa: D107
        self.path, self.inputs, self.tag = path, inputs, uuid.uuid4().hex[:12]
        self.location = LocalDirectory(Path(path).parent)
        self.lock: OutputLock | None = None
        self.staged: Path | None = None  # the temporary file, where this process staged it
        self.size = 0

    def begin(self, *, purpose: str, overwrite: bool) -> Begun:
        check_not_input(self.path, self.inputs, name="output")
        self.lock = lock = lock_output(self.path, purpose=purpose)  # released by finish or abort (the driver's)
        if lock.previous:  # a killed writer's temporary file, by the tag it journaled
            killed = {(e.file, e.tag) for e in lock.previous if e.file and e.tag}
            sweep_temporaries(lock.output.parent, set(), killed)
            lock.forget()
        if not overwrite and os.path.lexists(lock.output):  # under the lock: no writer of ours is replacing it
            raise FileExistsError(f"{self.path}: exists already ({describe_file(lock.output)}); pass "
                                  "overwrite=True (--overwrite) to replace it")  # fmt: skip
        lock.journal(JournalEntry(file=lock.output.name, tag=self.tag))
        return Begun(None)

    def stage(self, save_id: str, rank: int) -> Staging:  # noqa: ARG002 - one file, made by the process that began
        assert self.lock is not None, "the file is staged by the process that began its save"
        out = self.lock.output
        self.staged = out.with_name(f".{out.name}.{self.tag}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        with open(self.staged, "xb"):  # (atomic.TAGGED_TEMP_NAME) exclusively: never through a symlink
            pass
        return Staging(self.staged, durable=True, scratch=False)

    def commit(self, begun: Begun | None, data: bytes | None) -> None:  # noqa: ARG002 - held by the lock
        if data is None:
            return
        staged = self.staged
        assert self.lock is not None and staged is not None, "the file is committed by the process that staged it"
        try:
            fd = os.open(staged, os.O_RDWR | os.O_NOFOLLOW)
            try:
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], done)
                os.fsync(fd)
                self.size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            os.replace(staged, self.lock.output)
        except OSError as exc:
            raise OSError(exc.errno, f"{self.path}: cannot write the checkpoint file: {exc.strerror or exc}") from exc
        fsync_dir(self.lock.output.parent)

    def finish(self, begun: Begun | None, *, keep: frozenset[str]) -> None:  # noqa: ARG002 - one file
        if self.lock is not None:
            self.lock.release()

    def abort(self, begun: Begun | None, staging: Staging, names: Sequence[str]) -> None:  # noqa: ARG002
        try:
            if self.staged is not None:
                self.staged.unlink(missing_ok=True)
        finally:
            if self.lock is not None:  # (where this process began: taken there)
                self.lock.release()


def write_file(
    obj: Any, path: str | os.PathLike[str], *, inputs: Iterable[Any] = (), overwrite: bool = True
) -> int:
    """``torch.save`` of ``obj`` as the one file ``path`` (:func:`write_stream`). Returns the file's size."""
    return write_stream(partial(save_into, obj), path, inputs=inputs, purpose="write a file", overwrite=overwrite)


def write_stream(
    write: Callable[[BinaryIO], Any], path: str | os.PathLike[str], *, inputs: Iterable[Any] = (), purpose: str,
    overwrite: bool = True,
) -> int:  # fmt: skip
    """One file ``path`` saved by this process (:class:`FileWriter`): ``write(file)`` fills the (seekable) staged
    file. An existing file is replaced when ``overwrite`` (the API's default), else refused with ``FileExistsError``
    and left as it was (the command line's default: ``-o FILE`` replaces only with ``--overwrite``). Returns the
    file's size."""
    writer = FileWriter(path, inputs=inputs)
    with saving(writer, None, save_id=writer.tag) as save:
        save.begin(purpose=purpose, overwrite=overwrite)
        try:
            with open(save.staging.path, "r+b") as file:
                write(file)
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: cannot write the checkpoint file: {exc.strerror or exc}") from exc
        save.commit(b"")
    return writer.size
