"""Loading a fairseq / metaseq shard file without running code from it.

Every file is read with ``torch.load(weights_only=True, mmap=True)`` through the gate for foreign files
(:func:`~fsdp_optim.disk.untrusted.load_foreign`). fairseq and metaseq load their own files with
``weights_only=False``, because ``cfg`` may hold ``argparse.Namespace`` objects (and ``extra_state`` numpy
scalars). Those data-only classes, and only those, are allowed (:data:`DATA_ONLY_GLOBALS`); anything else in a
file is refused naming the classes, and the caller may allow named classes it trusts (``allow_globals``).
Nothing from a file is ever executed.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_optim.disk.untrusted import load_foreign

__all__ = ["DATA_ONLY_GLOBALS", "load_shard"]


def _data_only_globals() -> list[Any]:
    """Classes whose unpickling only builds plain data (no ``__setstate__`` or ``__reduce__`` code of theirs runs)."""
    allowed: list[Any] = [argparse.Namespace]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return allowed
    core = np._core if hasattr(np, "_core") else np.core  # type: ignore[attr-defined]  # numpy 2, numpy 1
    scalar = core.multiarray.scalar
    allowed += [(scalar, "numpy.core.multiarray.scalar"), (scalar, "numpy._core.multiarray.scalar"), np.dtype]
    allowed += [
        getattr(np.dtypes, name)
        for name in dir(getattr(np, "dtypes", None))
        if name.endswith("DType") and not name.startswith(("Object", "Void", "String", "StrDType"))
    ]
    return allowed


DATA_ONLY_GLOBALS = tuple(_data_only_globals())


def _resolve_global(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"allow_globals: cannot import '{name}' ({exc}); give 'module.Class' of an importable class"
        ) from exc


def load_shard(path: Path, *, allow_globals: Sequence[str] = (), mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True, mmap=...)`` through the gate for foreign files
    (:func:`~fsdp_optim.disk.untrusted.load_foreign`) with :data:`DATA_ONLY_GLOBALS` (and ``allow_globals``)
    allowed. Refuses a file that holds other classes, naming all of them."""
    allowed = [*DATA_ONLY_GLOBALS, *(_resolve_global(name) for name in allow_globals)]
    return load_foreign(path, allowed_globals=allowed, mmap=mmap)
