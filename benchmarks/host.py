"""Where a run ran, for the header every report starts with (``report.Run``): the machine, its load averages, the
package measured and the storage its checkpoints were written to."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def machine() -> str:
    """CPU model, cores, memory, GPUs and OS of this machine, in one line."""
    import torch

    cpu = platform.processor() or platform.machine()
    memory = ""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        kib = int(next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")).split()[1])
        memory = f", {kib / (1 << 20):.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    gpu = f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {os.cpu_count()} cores{memory}{gpu}, {platform.system()} {platform.release()}"


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def package() -> str:
    """Which fsdp_optim was measured: its commit, and whether its files differ from it."""
    import fsdp_optim

    where = Path(fsdp_optim.__file__).parent
    git = ["git", "-C", str(where)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "."], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"fsdp_optim {fsdp_optim.__version__} at {where} (not in a git checkout)"
    return f"fsdp_optim {fsdp_optim.__version__} at commit {commit}" + (" with uncommitted changes" if dirty else "")


def storage(path: Path) -> str:
    return f"{path} ({'tmpfs' if str(path).startswith('/dev/shm') else 'file system'})"
