"""``python -m benchmarks.offline_parallel --on-disk`` (``benchmarks/offline_parallel/on_disk.py``): its floor copies
every byte once into as many bytes of output, its page-cache drop empties the cache of a file on disk, and its
stored page is what its stored JSON renders."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # fairscale's wheel installs a top-level ``benchmarks`` too

from benchmarks.offline_parallel import on_disk, render_disk  # noqa: E402


def test_the_floor_writes_every_byte_once_in_order(tmp_path: Path) -> None:
    """Inputs of odd sizes (one larger than a piece): the 3 outputs concatenated are the inputs concatenated, and
    their sizes differ by at most one share's rounding."""
    sizes = [5, (8 << 20) + 3, 1 << 20, 0]
    inputs = []
    for k, n in enumerate(sizes):
        path = tmp_path / f"in{k}"
        path.write_bytes(os.urandom(n))
        inputs.append(path)
    written = on_disk.floor(inputs, tmp_path / "out")
    outputs = [tmp_path / "out" / f"part{k}" for k in range(3)]
    assert written == sum(sizes), f"{written} bytes written of {sum(sizes)}"
    assert b"".join(p.read_bytes() for p in outputs) == b"".join(p.read_bytes() for p in inputs), "the bytes differ"
    lengths = [p.stat().st_size for p in outputs]
    assert max(lengths[:2]) - min(lengths[:2]) == 0 and lengths[2] <= lengths[0], f"uneven parts {lengths}"


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_dropped_empties_the_page_cache_of_a_file_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 << 20))
    drop = on_disk.dropped([path])
    if drop["resident_after"] and os.statvfs(tmp_path).f_fsid == os.statvfs("/dev/shm").f_fsid:
        pytest.skip("tmp_path is on tmpfs, whose pages cannot be dropped")
    assert drop["resident_before"] > 0 and drop["resident_after"] == 0, f"the page cache was not dropped: {drop}"


def test_the_stored_page_renders_from_its_json() -> None:
    """benchmarks/results/offline_16g.md is what its JSON renders, verdicts included."""
    stored = json.loads((ROOT / "benchmarks" / "results" / "offline_16g.json").read_text())
    assert render_disk.targets(stored) == stored["targets"], "the verdicts differ from the stored ones"
    assert render_disk.markdown(stored) == (ROOT / "benchmarks" / "results" / "offline_16g.md").read_text(), "the page"
