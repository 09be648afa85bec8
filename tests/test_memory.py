"""Memory discipline: during a gather only the recipient allocates full-size buffers.

Two ranks train a model of 8.4M parameters with Adam (full state: 2 x 4 B x 8.4M = 64 MiB; each rank
holds half), then gather to rank 0. Each rank measures its peak RSS growth over the call: free heap
pages are handed back (``malloc_trim``) so that a new buffer must take fresh pages, the peak is reset
(``/proc/self/clear_refs`` "5") and read back from ``VmHWM`` after the call.

- The non-recipient's growth stays below 1/16 of the full state, less than any one of its own shards.
- The recipient's growth is the full state, within a factor of 2 either way.
- Control: with ``recipient_rank=None`` the same probe on rank 1 does see the full state arrive, so the
  first measurement is not blind.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

from fsdp_optim import FullyShardedDataParallel as FSDP

WORLD_SIZE = 2
LAYERS, WIDTH = 8, 1024
NON_RECIPIENT_BOUND = 1 / 16  # of the full state's bytes


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise AssertionError(f"/proc/self/status has no {field}")


def _peak_rss_growth(call: Any) -> tuple[Any, int]:
    """``call()``'s result and how far the process's resident memory rose above where it started."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # glibc: return free heap pages, so new buffers must take fresh ones
    start = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    result = call()
    return result, _status_bytes("VmHWM") - start


def _gather_and_measure(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    full_bytes = sum(p.numel() for p in net.parameters()) * 4 * 2  # Adam's exp_avg and exp_avg_sq, fp32
    model = FSDP(nn.Sequential(*(FSDP(layer) for layer in net)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, WIDTH)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

    full, to_recipient = _peak_rss_growth(lambda: model.gather_full_optim_state_dict(optim, recipient_rank=0))
    got_dict = full is not None
    del full
    full, to_everyone = _peak_rss_growth(lambda: model.gather_full_optim_state_dict(optim, recipient_rank=None))
    return {"full_bytes": full_bytes, "got_dict": got_dict, "to_recipient": to_recipient, "to_everyone": to_everyone}


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("peak RSS is read from /proc")
    return run_ranks(_gather_and_measure, WORLD_SIZE)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def test_non_recipient_allocates_no_full_size_buffers(measured: list[dict[str, Any]]) -> None:
    rank1 = measured[1]
    assert not rank1["got_dict"]
    bound = rank1["full_bytes"] * NON_RECIPIENT_BOUND
    assert rank1["to_recipient"] < bound, (
        f"rank 1 grew {_mib(rank1['to_recipient'])} while sending to rank 0; bound {_mib(bound)}, "
        f"full state {_mib(rank1['full_bytes'])}"
    )


def test_recipient_allocates_about_the_full_state(measured: list[dict[str, Any]]) -> None:
    rank0 = measured[0]
    assert rank0["got_dict"]
    full = rank0["full_bytes"]
    assert full / 2 < rank0["to_recipient"] < 2 * full, f"rank 0 grew {_mib(rank0['to_recipient'])}, full {_mib(full)}"


def test_probe_sees_a_full_state_arrive(measured: list[dict[str, Any]]) -> None:
    for rank, m in enumerate(measured):
        full = m["full_bytes"]
        assert full / 2 < m["to_everyone"] < 2 * full, f"rank {rank} grew {_mib(m['to_everyone'])}, full {_mib(full)}"
