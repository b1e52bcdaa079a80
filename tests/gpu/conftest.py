import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run on a GPU machine: see tests/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "engine_jobs(builder=fn): engine/server jobs this test judges; "
                            "every selected test's jobs run in one GPU pool (see engine_pool)")


@pytest.fixture(scope="session")
def engine_pool(request):
    """Run the jobs of every selected test in one pool, side by side where they fit, once per pytest run.

    A test marked ``engine_jobs(builder=fn)`` declares ``fn() -> {name: (spec or callable, GPUs)}``
    and reads its results with ``e2e.result(engine_pool, name)``.
    """
    from . import e2e

    marks = (m for item in request.session.items for m in item.iter_markers("engine_jobs"))
    return e2e.run_jobs(e2e.marked_jobs(marks))
