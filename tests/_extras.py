"""What the test extra brings (s3fs and botocore, SeaweedFS's ``weed`` binary, fairseq): a test that needs one of
them fails here when it is missing, since CI installs the extra and a skip would hide a broken install.

The lent GPU machine's image has none of them (``.ci/gpu-check --suite`` runs the suite there): it sets
``FSDP_OPTIM_MISSING_EXTRAS=skip``, and then such a test is skipped, its reason naming what is missing.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

SKIP_ENV = "FSDP_OPTIM_MISSING_EXTRAS"
INSTALL_HINT = 'install the test extra: python -m pip install -c constraints.txt -e ".[test]"'


def skipping() -> bool:
    """True where a missing extra skips its tests (the GPU image) instead of failing them."""
    return os.environ.get(SKIP_ENV) == "skip"


def missing(what: str, hint: str = INSTALL_HINT) -> NoReturn:
    """Fail (or, where ``skipping()``, skip) the current test or module: it needs ``what``, missing here; ``hint``
    says what to do."""
    if skipping():
        pytest.skip(f"needs {what}, which this machine lacks ({SKIP_ENV}=skip)", allow_module_level=True)
    pytest.fail(f"needs {what}: {hint}", pytrace=False)
