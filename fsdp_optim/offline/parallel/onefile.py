"""``consolidate -o FILE.safetensors`` by a team of processes (:class:`~fsdp_optim.job.team.Team`): one file, laid
out before any byte (:func:`~fsdp_optim.offline.onefile_layout.lay_out`), each process writing its share of the tensors
(:func:`~fsdp_optim.offline.onefile.write_one_file`, the path one process takes too). The steps, every one ended by
an agreement (a failure anywhere fails every process, and nothing is committed)::

    every process   opens the source, lays the file out alike                    -> agree: the layout
    process 0       opens the output: a local file (disk/one_file.py: lock, journal, a temporary file
                    beside it, laid out by ftruncate; its path sent) or one multipart upload (refused if the
                    object is there, unless overwrite; its id sent)              -> agree: opened
    every process   writes its run of tensors (split by bytes, core/split.py, in file order): hashed as written, at
                    their offsets or as its parts; the watch counts bytes and stops all on a failure
                                                                                 -> agree: every share written
    process 0       gathers every share's checksums, writes the header (over its planned room, or into the part
                    it held), and renames the file or completes the upload       -> agree: the commit

The bytes are those one process writes (the layout, the tensors and their checksums do not depend on who wrote
them). A local output must be on a file system every process sees. A process killed anywhere: the others fail
within the team's timeout; process 0 removes the temporary file or aborts the upload (killed itself, the next
writer's recovery, or the bucket's lifecycle rule, removes what it left).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from fsdp_optim.job.team import Team
from fsdp_optim.offline.onefile import write_one_file
from fsdp_optim.offline.onefile_layout import described, lay_out

__all__ = ["consolidate_across"]


def consolidate_across(
    team: Team, opening: Callable[[], AbstractContextManager[Any]], output: str | os.PathLike[str], *,
    rank: int | None, no_model: bool, inputs: tuple[Any, ...], overwrite: bool, bar: bool,
) -> str | None:  # fmt: skip
    """The module docstring's steps on this process; ``opening()`` opens the source (and checks the output) on
    each. Returns the report (:func:`~fsdp_optim.offline.onefile_layout.described`) on process 0, ``None`` elsewhere."""
    with ExitStack() as stack:
        with team.step("consolidate: planning failed; nothing was written"):
            opened = stack.enter_context(opening())
            layout = lay_out(opened, rank=rank, no_model=no_model)
        size = write_one_file(team, layout, output, inputs=inputs, overwrite=overwrite, trim=opened.trim, bar=bar)
        return described(layout, size) if team.rank == 0 else None
