import os
import sys

# Tests import their helpers (_dist, _models, _checks) as top-level modules, in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))

import _gpu_plan  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: a long campaign; skipped unless FSDP_OPTIM_SLOW=1 (CI runs the bounded sample of each)"
    )
    config.addinivalue_line(
        "markers",
        "gpu: a CUDA test (also given to every test with a skipif whose reason names CUDA or a GPU); "
        ".ci/gpu-check runs them all on a lent GPU with -m gpu",
    )


def _mark_gpu(items: list[pytest.Item]) -> None:
    for item in items:
        if _gpu_plan.is_cuda_test(item):  # a skip condition whose reason names CUDA or a GPU
            item.add_marker(pytest.mark.gpu)


def pytest_collection_finish(session: pytest.Session) -> None:
    _gpu_plan.write_plan(session.items)  # what a GPU machine runs, where FSDP_OPTIM_GPU_PLAN asks (.ci/gpu-check)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_gpu(items)  # before -m deselects (pytest's own hook runs after this one)
    if os.environ.get("FSDP_OPTIM_SLOW"):
        return
    skip = pytest.mark.skip(reason="a long campaign: set FSDP_OPTIM_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A SeaweedFS S3 server on loopback for the whole session (tests/_s3.py): an ``_s3.S3Endpoint``.

    Started on first use only; fails (does not skip) when the test extra's ``weed`` binary is missing.
    """
    import _s3

    server = _s3.start_server(tmp_path_factory.mktemp("s3"))
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def fault_proxy(s3_server):
    """A fresh fault-injecting proxy in front of ``s3_server`` for one test (tests/_fault_proxy.py)."""
    from _fault_proxy import FaultProxy

    proxy = FaultProxy(s3_server).start()
    try:
        yield proxy
    finally:
        proxy.close()
