import os
import sys

# Tests import their helpers (_dist, _models, _checks) as top-level modules, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: a long campaign; skipped unless FSDP_OPTIM_SLOW=1 (CI runs the bounded sample of each)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("FSDP_OPTIM_SLOW"):
        return
    skip = pytest.mark.skip(reason="a long campaign: set FSDP_OPTIM_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
