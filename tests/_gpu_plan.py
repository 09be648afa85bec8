"""Which CUDA tests a machine with N GPUs runs, and why each other one cannot run there (``.ci/gpu-check``).

A CUDA test says what it needs in the reason of its ``skipif``: ``needs a CUDA device ...`` (one GPU) or
``needs two CUDA devices ...`` (``two``/``2``/``four``...). That count is the only thing a CUDA test may skip for
on a GPU machine. With ``FSDP_OPTIM_GPU_PLAN=PATH`` in the environment, collection writes the plan for
``FSDP_OPTIM_GPUS`` GPUs (default: ``torch.cuda.device_count()``; a CPU machine sets 1 to see what a one-GPU
machine will run) to ``PATH``::

    {"gpus": 1,
     "runs": ["tests/test_stager.py::test_gpu_saves_...", ...],          # runs there; must pass
     "not_applicable": {"tests/test_cuda_scatter.py::test_...": "needs 2 CUDA devices, this machine has 1: ..."},
     "unexplained": {"tests/test_gather.py::test_y": "skipif reason names no CUDA device count: 'flaky'"}}

``unexplained`` lists the CUDA tests that could skip for something else than a stated missing resource (a
``skipif`` whose reason names no device count, a ``skip`` mark, a ``pytest.skip``/``importorskip`` call in the
body): gpu-check fails on any. Reads marks and sources only: it runs nothing and needs no GPU.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

# A skip condition whose reason names CUDA or a GPU makes its test a CUDA test (marked ``gpu``, tests/conftest.py).
NEEDS_A_GPU = re.compile(r"\b(cuda|gpus?)\b", re.IGNORECASE)
NEEDS_COUNT = re.compile(r"\bneeds (a|one|two|three|four|eight|\d+) CUDA devices?\b", re.IGNORECASE)
WORDS = {"a": 1, "one": 1, "two": 2, "three": 3, "four": 4, "eight": 8}
SKIPS_IN_BODY = ("pytest.skip(", "importorskip(")


def is_cuda_test(item: pytest.Item) -> bool:
    return any(NEEDS_A_GPU.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def needs(reason: str) -> int | None:
    """How many CUDA devices a skip reason says its test needs (``needs two CUDA devices: ...`` -> 2), or None."""
    found = NEEDS_COUNT.search(reason)
    if found is None:
        return None
    word = found.group(1).lower()
    return int(word) if word.isdigit() else WORDS[word]


def _judge(item: pytest.Item) -> tuple[int, list[str]]:
    """The GPUs ``item`` needs, and every way it could skip for something else."""
    need, other = 0, []
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        count = needs(reason)
        if count is None:
            other.append(f"skipif reason names no CUDA device count: {reason!r}")
        need = max(need, count or 0)
    other += [f"skip mark: {m.kwargs.get('reason', m.args)!r}" for m in item.iter_markers("skip")]
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    other += [f"calls {call}...) in its body" for call in SKIPS_IN_BODY if call in source]
    return need, other


def plan(items: list[pytest.Item], gpus: int) -> dict[str, Any]:
    """The plan (module doc's shape) of the CUDA tests among ``items`` on a machine with ``gpus`` GPUs."""
    runs: list[str] = []
    not_applicable: dict[str, str] = {}
    unexplained: dict[str, str] = {}
    for item in items:
        if not is_cuda_test(item):
            continue
        need, other = _judge(item)
        if other:
            unexplained[item.nodeid] = "; ".join(other)
        elif need > gpus:
            reasons = "; ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
            not_applicable[item.nodeid] = f"needs {need} CUDA devices, this machine has {gpus}: {reasons}"
        else:
            runs.append(item.nodeid)
    return {"gpus": gpus, "runs": runs, "not_applicable": not_applicable, "unexplained": unexplained}


def gpus_here() -> int:
    """``FSDP_OPTIM_GPUS`` when set (the machine a plan is made for), else the GPUs torch sees."""
    told = os.environ.get("FSDP_OPTIM_GPUS")
    if told is not None:
        return int(told)
    import torch

    return torch.cuda.device_count()


def write_plan(items: list[pytest.Item]) -> None:
    """Where ``FSDP_OPTIM_GPU_PLAN`` names a file, the plan of ``items`` into it (each pytest-xdist worker writes
    the same plan: atomically, and not over a fuller one with nothing)."""
    target = os.environ.get("FSDP_OPTIM_GPU_PLAN")
    if not target or (not items and Path(target).exists()):
        return
    found = plan(items, gpus_here())
    part = Path(f"{target}.{os.getpid()}")
    part.write_text(json.dumps(found, indent=1) + "\n")
    os.replace(part, target)
