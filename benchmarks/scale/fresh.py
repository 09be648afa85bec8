"""The fixed costs of ``reshard`` (``benchmarks.scale --fresh``): a ``W x U`` checkpoint re-cut to ``3W/4`` ranks in
fresh interpreters, its first call in a process against its second and the byte floor.

Each of ``repeats`` fresh interpreters (``python -m benchmarks.scale.fresh --measure SRC W' OUT``, through
``peak.fresh``) imports torch first, as a training script or tool has it, then times the import of
``fsdp_optim.reshard``, the first call and the second call (wall seconds, each into a directory of its own).
``first`` is the import plus the first call; the floor is ``ops.floor_reshard``'s median in forked children. The
targets (issue 46): ``second / floor <= 2`` and ``first - second <= 0.1 s``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ..peak import fresh, reply


def measure(source: str, new_size: str, out: str) -> dict[str, float]:
    """In this fresh interpreter: the import, the first call and the second (seconds)."""
    import torch  # noqa: F401 - imported before the clock starts: its cost is no part of ours

    start = time.perf_counter()
    from fsdp_optim import reshard

    imported = time.perf_counter()
    reshard(source, int(new_size), Path(out) / "first")
    first = time.perf_counter()
    reshard(source, int(new_size), Path(out) / "second")
    second = time.perf_counter()
    return {"import_s": imported - start, "first_call_s": first - imported, "second_s": second - first}


def fixed_costs(world_size: int, units: int, src: Path, root: Path, floor: float, repeats: int) -> dict[str, Any]:
    """Medians of ``repeats`` fresh interpreters re-cutting ``src`` (``world_size`` ranks, ``units``), beside the
    floor (seconds); the row of ``--fresh``."""
    new_size = world_size * 3 // 4
    runs = [fresh("benchmarks.scale.fresh", src, new_size, root / f"run{k}") for k in range(repeats)]

    def median(key: str) -> float:
        return sorted(r[key] for r in runs)[len(runs) // 2]

    row = {"world_size": world_size, "units": units, "to": new_size, "files": world_size + new_size, "floor_s": floor}
    row.update({key: median(key) for key in ("import_s", "first_call_s", "second_s")})
    row["first_s"] = median("import_s") + median("first_call_s")
    row["second_x_floor"] = row["second_s"] / floor
    row["first_minus_second_s"] = row["first_s"] - row["second_s"]
    return row


if __name__ == "__main__":
    assert sys.argv[1] == "--measure", f"usage: python -m benchmarks.scale.fresh --measure SRC W' OUT, not {sys.argv[1:]}"
    reply(**measure(*sys.argv[2:]))
