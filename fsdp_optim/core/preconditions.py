"""Entry preconditions, each written once: roots, ranks, world sizes, full-dict shape, format versions.

Every public function and the CLI call these before planning; what a source *holds* is checked by the engine
(:func:`fsdp_optim.core.plan.plan`), and what a *path* is by :func:`fsdp_optim.formats.sharded.locate.source_kind`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from fsdp_optim.core.limits import MAX_WORLD_SIZE

__all__ = [
    "FULL_DICT_KEYS",
    "PLAIN_HINT",
    "check_full_dict",
    "check_rank",
    "check_version",
    "check_world_size",
    "is_full_dict",
]

FULL_DICT_KEYS = ("state", "param_groups", "param_names")
PLAIN_HINT = (
    "a plain optimizer's state_dict() names no parameters: add them with "
    "fsdp_optim.name_optimizer_state(optim.state_dict(), model) in Python, or on the command line with "
    "--param-names FILE (a JSON list of the model's named_parameters() names, or an object {name: shape})"
)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_rank(name: str, value: object, world_size: int, *, allow_none: bool = False) -> None:
    """Refuse a rank argument that is not an int in ``[0, world_size)`` (or ``None`` where allowed)."""
    if value is None and allow_none:
        return
    if not _is_int(value) or not 0 <= value < world_size:
        expected = "None or an int" if allow_none else "an int"
        raise ValueError(f"{name}: expected {expected} in [0, {world_size}), found {value!r}")


def check_world_size(name: str, value: object) -> None:
    """Refuse a world size that is not an int >= 1, or above the sane bound
    :data:`fsdp_optim.core.limits.MAX_WORLD_SIZE` (one rank file per rank)."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, found {value!r}")
    if value > MAX_WORLD_SIZE:
        raise ValueError(
            f"{name}: world size {value} is above the bound {MAX_WORLD_SIZE} (fsdp_optim.core.limits.MAX_WORLD_SIZE)"
        )


def check_version(version: object, source: str, latest: int) -> None:
    """The one format-version policy: an int in ``1..latest``; missing, 0, negative or newer is refused."""
    if not _is_int(version) or not 1 <= version <= latest:
        raise ValueError(
            f"{source}: format version {version!r}, but this fsdp_optim reads 1..{latest} (versions up to {latest})"
        )


def is_full_dict(obj: object) -> bool:
    """Whether ``obj`` has the keys of a full dict (its content is the engine's to check)."""
    return isinstance(obj, Mapping) and all(key in obj for key in FULL_DICT_KEYS)


def _some_keys(obj: Mapping[Any, Any], most: int = 40) -> str:
    keys = sorted(map(str, obj))
    return f"{keys[:most]}" + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_full_dict(obj: object, where: str) -> None:
    """Refuse anything without the full dict's top-level shape, saying what was found instead."""
    if not isinstance(obj, Mapping):
        raise TypeError(f"{where}: expected a dict (a full optimizer state dict), found {type(obj).__name__}")
    missing = [key for key in FULL_DICT_KEYS if key not in obj]
    if missing:
        hint = " (a fairscale-native dict: pass the model's layout to convert it)" if "param_id_map" in obj else ""
        if missing == ["param_names"] and "param_id_map" not in obj:
            hint = f"; {PLAIN_HINT}"
        raise ValueError(
            f"{where}: expected a full optimizer state dict with 'state', 'param_groups' and 'param_names' (the "
            f"output of gather_full_optim_state_dict); it has no '{missing[0]}' key (found keys "
            f"{_some_keys(obj)}){hint}"
        )
    for key, kind in (("state", Mapping), ("param_groups", (list, tuple)), ("param_names", Mapping)):
        if not isinstance(obj[key], kind):
            raise TypeError(
                f"{where}: '{key}' must be a {'dict' if kind is Mapping else 'list'}, found {type(obj[key]).__name__}"
            )
