"""The ``"whole"`` section of a named safetensors file (version 3): a whole checkpoint's model, ``extra``, tied names
beside its optimizer state, as ``consolidate -o FILE.safetensors`` writes it::

    "whole": {"model": ["embed.weight", ..., "head.weight", "block1.seen"],   # state_dict() names, in its order
              "rank": 0, "extra": "{\"rng\": {\"$extra\": 0}, ...}", "extra_tensors": ["extra/0"],
              "aliases": [["head.weight", "embed.weight"]]}                   # (tied name, parameter), optional

Pure: never imports ``torch.distributed`` and reads no file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Whole", "whole_from_json", "whole_to_json"]


@dataclass(frozen=True)
class Whole:
    """A whole checkpoint's part of a consolidated file (version 3): ``model`` the unwrapped ``state_dict()``'s
    names in its order (weights, tied names as copies, buffers), each a tensor of the file under that very name;
    ``extra`` the chosen ``rank``'s as a whole checkpoint's side file holds it (JSON text, each tensor a reference
    ``{"$extra": k}`` to the file's tensor ``extra/<k>``, listed in ``extra_tensors``); ``aliases`` the tied names
    ``(tied name, the parameter's name)``, ``None`` in a file written before they were listed (a reader then tells
    them apart by their bytes)."""

    model: tuple[str, ...]
    extra: str
    extra_tensors: tuple[str, ...]
    rank: int
    aliases: tuple[tuple[str, str], ...] | None = None


def whole_to_json(w: Whole) -> dict[str, Any]:
    """The section as JSON values (the optional members only when known)."""
    out: dict[str, Any] = {"model": list(w.model), "rank": w.rank, "extra": w.extra,
                           "extra_tensors": list(w.extra_tensors)}  # fmt: skip
    if w.aliases is not None:
        out["aliases"] = [list(pair) for pair in w.aliases]
    return out


def whole_from_json(raw: object, at: str) -> Whole:
    """The section read back, every member checked; ``ValueError`` naming ``at`` and what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError(f"{at}: expected an object, found {type(raw).__name__}")
    model, extras = _member(raw, "model", list, at), _member(raw, "extra_tensors", list, at)
    if not all(isinstance(n, str) for n in [*model, *extras]) or len({*model, *extras}) != len(model) + len(extras):
        raise ValueError(f"{at}: 'model' and 'extra_tensors' must list distinct tensor names")
    aliases = None
    if "aliases" in raw:
        pairs = _member(raw, "aliases", list, at)
        if not all(isinstance(p, list) and len(p) == 2 and p[0] in model and p[1] in model for p in pairs):
            raise ValueError(f"{at}: 'aliases' must list [tied name, parameter name] pairs of 'model' names")
        aliases = tuple((str(a), str(b)) for a, b in pairs)
    rank = _member(raw, "rank", int, at)
    return Whole(tuple(model), _member(raw, "extra", str, at), tuple(extras), rank, aliases)


def _member(raw: dict[str, Any], key: str, kind: type, at: str) -> Any:
    if key not in raw:
        raise ValueError(f"{at}: missing '{key}'")
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{at}: '{key}' must be {kind.__name__}, found {type(value).__name__}")
    return value
