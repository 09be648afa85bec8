"""JSON read from a file: every object's keys once, and nesting at most :data:`MAX_JSON_DEPTH` deep.

Pure: parses text it is given. ``json.loads`` keeps the last of two equal keys (``{"checksum": <wrong>,
"checksum": <right>}`` reads as the right one) and accepts any nesting its C parser reaches (~1,000 levels),
which our recursive consumers (copies, digests, the exact-JSON decoder) do not survive. So every JSON
document read from a file (manifests, layout files, safetensors headers and their metadata) is parsed
with :func:`unique_object` as its ``object_pairs_hook`` and walked once by :func:`check_depth` (level by
level, in list comprehensions: ~3 ms for the manifest of a 1,024-rank, 1,000-unit checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fsdp_optim.core.limits import MAX_JSON_DEPTH
from fsdp_optim.disk.text import escape

__all__ = ["DuplicateKeyError", "RefusedJSON", "check_depth", "duplicate", "loads", "unique_object"]

_CONTAINERS = (dict, list, tuple)


class RefusedJSON(ValueError):
    """Well-formed JSON that we refuse (a key given twice, too deep), its message naming the file."""


class DuplicateKeyError(ValueError):
    """An object of a JSON document names one key twice (``key``: the key)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key '{escape(key, limit=80)}' appears twice in one object")
        self.key = key


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object as a dict, refusing a key given twice."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(k)
            seen.add(k)
    return d


def loads(text: str | bytes, *, where: str, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(text)`` with each key once and at most :data:`MAX_JSON_DEPTH` levels: a ``ValueError`` as
    ``json`` raises it for text that is not JSON, :class:`RefusedJSON` naming ``where`` for a key given twice
    or a value nested too deep."""
    try:
        value = json.loads(text, object_pairs_hook=unique_object, parse_constant=parse_constant)
    except DuplicateKeyError as exc:
        raise duplicate(exc, where) from None
    except RecursionError:
        raise RefusedJSON(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    check_depth(value, where)
    return value


def duplicate(exc: DuplicateKeyError, where: str) -> RefusedJSON:
    """The error for a key given twice in the JSON of ``where``."""
    return RefusedJSON(f"{where}: {exc} (a JSON file we read names each key once: which one would count?)")


def check_depth(value: Any, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse ``value`` (parsed JSON: dicts, lists, tuples) nested deeper than ``limit`` containers, naming
    the path to the first container too deep. Iterative: one pass per level."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if type(v) is dict else v) if isinstance(c, _CONTAINERS)]
        if not level:
            return
    parts = _deep_path(value, limit) or []  # the path (``['key'][3]...``) to it, shown up to 8 parts
    shown = "".join(parts[:8]) + (f"... ({len(parts) - 8} more levels)" if len(parts) > 8 else "")
    raise RefusedJSON(
        f"{where}, at {shown}: nested deeper than {limit} levels (lists and objects in lists and objects; a file of "
        "ours is at most 9 deep)"
    )


def _deep_path(value: Any, left: int) -> list[str] | None:
    """The parts of a path to a container below ``value`` more than ``left`` levels down (depth first: the recursion
    stops at ``left``, at most :data:`MAX_JSON_DEPTH`); ``None`` when there is none."""
    if left == 0:
        return []
    for key, child in value.items() if type(value) is dict else enumerate(value):
        if isinstance(child, _CONTAINERS) and (below := _deep_path(child, left - 1)) is not None:
            return [f"['{escape(key, limit=40)}']" if isinstance(key, str) else f"[{key}]", *below]
    return None
