"""The code blocks of README.md and docs/*.md, as tests/test_docs.py runs them and ``docs.regenerate`` rewrites them.

A fenced block may be indented (inside a list item); its body is dedented. The HTML comment on the line right
before a fence says how its block runs: ``<!-- not run: REASON -->`` (never run; the reason is required),
``<!-- run: world size N -->`` (a python block: a job of N ranks instead of the default 2). A ``console`` block
holding ``$ fsdp-optim`` commands is run and its output rewritten by ``python -m docs.regenerate`` unless it is
marked not run.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<what>not run|run):\s*(?P<detail>.*?)\s*-->\s*$")
DEFAULT_WORLD_SIZE = 2


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is (``page``, the fence's 1-based ``line``), its language and dedented body."""

    page: str
    line: int
    lang: str
    body: str
    start: int  # index of the first body line in the page's lines
    stop: int  # index of the closing fence
    not_run: str | None = None
    world_size: int = DEFAULT_WORLD_SIZE

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, stop = fence["indent"], i + 1
        while stop < len(lines) and lines[stop].strip() != "```":
            stop += 1
        marker = MARKER.match(lines[i - 1]) if i else None
        not_run, world_size = None, DEFAULT_WORLD_SIZE
        if marker and marker["what"] == "not run":
            not_run = marker["detail"]
        elif marker:
            world_size = int(re.fullmatch(r"world size (\d+)", marker["detail"])[1])  # type: ignore[index]
        body = textwrap.dedent("\n".join(lines[i + 1 : stop])) + "\n"
        assert not indent or all(not s.strip() or s.startswith(indent) for s in lines[i + 1 : stop]), page
        found.append(Block(page, i + 1, fence["lang"], body, i + 1, stop, not_run, world_size))
        i = stop + 1
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for path in pages() for b in blocks(path) if b.lang == lang]
