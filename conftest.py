# SPDX-License-Identifier: Apache-2.0
"""The rank servers the CPU tests of tests/ and benchmarks/ share.

A process that imports vLLM spends ~13 CPU seconds on it. Two servers pay that once for the whole run,
and every run still forks fresh processes from them, so no vLLM state passes from one test to the next:
``harness.dist``'s gloo server (``run_distributed``) and one ``tests.fake_cuda.RankServer`` (the
``fake_cuda_ranks`` fixture). Both start with the first test, if a collected test needs them, so that
their imports run beside the tests that come first (and inside pytest's output capture: what they
print is shown with the test that was running).
"""

import os
import shutil
import tempfile

import pytest

# vLLM names its ZMQ IPC sockets (the TP groups' shared-memory broadcasters among them) after a fresh
# uuid in VLLM_RPC_BASE_PATH, /tmp by default, and leaves them there when a rank exits without closing
# them: the tests' ranks put theirs in a folder of this run, which goes when the run ends. Set before
# the rank servers start, so that every process of the run inherits it.
_RPC_DIR = None
if "VLLM_RPC_BASE_PATH" not in os.environ:
    _RPC_DIR = tempfile.mkdtemp(prefix="qwen36_pcp_tests_")
    os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR


def pytest_unconfigure(config):
    if _RPC_DIR is not None:
        shutil.rmtree(_RPC_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _rank_servers(request):
    from harness import dist

    items = request.session.items
    if any(getattr(getattr(item, "module", None), "run_distributed", None) is dist.run_distributed
           for item in items):
        dist.start_gloo_server()
    server = None
    if any("fake_cuda_ranks" in item.fixturenames for item in items):
        from tests.fake_cuda import RankServer

        server = RankServer()
    yield server
    if server is not None:
        server.close()


@pytest.fixture(scope="session")
def fake_cuda_ranks(_rank_servers):
    """The test run's ``tests.fake_cuda.RankServer``: ``run`` forks fresh ranks, ``isolated`` one process."""
    if _rank_servers is not None:
        yield _rank_servers
        return
    from tests.fake_cuda import RankServer

    with RankServer() as server:  # asked for only while the tests ran (getfixturevalue): started now
        yield server
