"""One file a team writes (``consolidate -o FILE.safetensors`` under torchrun, to a local file or as the parts of
one multipart upload): the source opened and the file laid out on every process, agreed before a byte is written."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from fsdp_optim.job.team import Team
from fsdp_optim.offline.onefile import FileLayout, lay_out

__all__ = ["planned"]


def planned(
    team: Team, stack: ExitStack, opening: Callable[[], AbstractContextManager[Any]], *, rank: int | None,
    no_model: bool,
) -> tuple[Any, FileLayout]:  # fmt: skip
    """The source opened (held open by ``stack``) and the one file laid out on this process, once every process has:
    ``(opened, layout)``; the first failure raised on every process, before a byte is written."""
    failure: BaseException | None = None
    opened: Any = None
    layout = None
    try:
        opened = stack.enter_context(opening())
        layout = lay_out(opened, rank=rank, no_model=no_model)
    except Exception as exc:
        failure = exc
    team.agree(failure, "consolidate: planning failed; nothing was written")
    if layout is None:  # every process planned (else agree raised)
        raise RuntimeError("consolidate: no layout after an agreed plan")
    return opened, layout
