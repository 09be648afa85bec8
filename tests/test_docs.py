"""The documentation site builds with no warning (``mkdocs build --strict``, as the docs extra installs it; CI
installs it through the test extra, so this is skipped only where mkdocs is missing), and its API reference
renders every public name of ``fsdp_optim``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_optim

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason='needs the docs extra: pip install -e ".[docs]"')
def test_mkdocs_build_strict_renders_every_public_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(fsdp_optim\.[\w.]+)"', api))
    missing = [name for name in fsdp_optim.__all__ if f"fsdp_optim.{fsdp_optim._HOME[name]}.{name}" not in anchors]
    assert not missing, f"public names the API reference does not render: {missing}"
    assert ":func:`" not in api and ":mod:`" not in api, "a Sphinx role was printed as it is"
