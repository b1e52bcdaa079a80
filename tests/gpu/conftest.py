# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

_SELECTED = []  # the collected tests (their engine_jobs marks make the pool)
_POOL = {}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the selected tests' jobs run
def pytest_collection_modifyitems(config, items):
    _SELECTED[:] = items
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run on a GPU machine: see tests/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "engine_jobs(builder=fn): engine/server jobs this test judges; "
                            "every selected test's jobs run in one GPU pool (see engine_pool)")


@pytest.fixture
def engine_pool():
    """Run the jobs of every selected test in one pool, side by side where they fit, once per pytest run.

    A test marked ``engine_jobs(builder=fn)`` declares ``fn() -> {name: (spec or callable, ranks)}``
    and reads its results with ``e2e.result(engine_pool, name)``.
    """
    from . import e2e

    if "results" not in _POOL:
        marks = (m for item in _SELECTED for m in item.iter_markers("engine_jobs"))
        _POOL["results"] = e2e.run_jobs(e2e.marked_jobs(marks))
    return _POOL["results"]
