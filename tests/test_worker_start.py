# SPDX-License-Identifier: Apache-2.0
"""The plugin in a process that vLLM starts fresh: a worker of a secondary node.

vLLM calls ``vllm.plugins.load_general_plugins()`` in every process it starts. The workers are the
ones that matter most and the easiest to get wrong: ``vllm serve`` sets the multiprocessing start
method to ``spawn`` (``cli_env_setup``), so every worker is a new interpreter that has only what
vLLM's own start-up gives it. This test runs that start-up as vLLM 0.20.2 runs it on the second node
of a two-node PCP deployment, ``vllm serve ... --nnodes 2 --node-rank 1 --headless``:

    vllm.entrypoints.cli.main.main()            (the ``vllm`` console script, in ``python -c``)
      ServeSubcommand.cmd -> run_headless       builds node 1's own VllmConfig (our startup checks)
        MultiprocExecutor -> WorkerProc.make_worker_process    (spawn: a fresh interpreter per rank)
          WorkerProc.worker_main -> WorkerProc.__init__
            WorkerWrapperBase.init_worker       load_general_plugins(): entry point -> register()
              worker class (parallel_config.worker_cls), then worker.init_device()

The Ray workers go through the same ``WorkerWrapperBase.init_worker`` (``RayWorkerWrapper`` keeps
it; ``RayWorkerProc`` of ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1`` is a ``WorkerProc``).

Only two things stand in for the GPU: the launcher's platform is ``tests.fake_cuda``'s (vLLM refuses
to build a config on a machine without one), and ``--worker-cls`` names a subclass of the plugin's
``PCPWorker`` whose ``init_device`` (the first thing that needs a GPU, right before the model is built)
records what the plugin left in its process and stops the worker. The launcher then fails the way
vLLM fails when a worker does not start, which is what this test expects.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCH = "Qwen3_6ForCausalLM"
PROBE_DIR_ENV = "QWEN36_PCP_TEST_PROBE_DIR"
PROBE_WORKER = "tests.test_worker_start.ProbeWorker"
TIMEOUT_S = 180

# What ``patches.install()`` replaces in vLLM 0.20.2, and nothing else (vLLM's GDN autotuner is kept to
# its race-free configs only on a GPU; the runner, the worker and the layers are subclasses).
HOOKS = {
    "vllm.v1.engine.core.resolve_kv_cache_block_sizes",
    "vllm.v1.core.sched.scheduler.Scheduler.__init__",
    "vllm.v1.kv_cache_interface.FullAttentionSpec.max_memory_usage_bytes",
    "vllm.engine.arg_utils.EngineArgs.create_engine_config",
    "vllm.engine.arg_utils.EngineArgs.add_cli_args",
    "vllm.v1.engine.detokenizer.FastIncrementalDetokenizer.__init__",
}


# ======================================================================= in the worker process
def _name_of(owner, attr: str) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{attr}"
    return f"{owner.__name__}.{attr}"


def _hooks_in_process() -> dict:
    """Every function of vLLM's loaded modules (module level, or of a class defined there) that
    carries the plugin's mark: its id, and whether the function it wraps carries the mark too."""
    from qwen36_pcp.patches import ORIGINAL as _PATCHED_MARK

    found = {}

    def look(owner):
        for attr, value in list(vars(owner).items()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if not isinstance(value, types.FunctionType):  # the wrappers are plain functions
                continue
            original = getattr(value, _PATCHED_MARK, None)
            if original is not None:
                found[_name_of(owner, attr)] = {
                    "id": id(value), "twice": getattr(original, _PATCHED_MARK, None) is not None}

    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "vllm" or module_name.startswith("vllm.")):
            continue
        look(module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module_name:
                look(value)
    return found


def _plugin_state(worker) -> dict:
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models import config as model_configs

    check = model_configs.MODELS_CONFIG_MAP.get(ARCH)
    return {
        "registered": ARCH in ModelRegistry.get_supported_archs(),
        # the class the worker's model loader would build
        "model_cls": _qualname(get_model_architecture(worker.model_config)[0]),
        "config_check": None if check is None else _qualname(check),
        "hooks": _hooks_in_process(),
    }


def _qualname(obj) -> str | None:
    return None if obj is None else f"{obj.__module__}.{obj.__qualname__}"


def _rejected_in_worker(vllm_config) -> str | None:
    """Run vLLM's model-config verification (what ``VllmConfig.__post_init__`` runs) on a copy of the
    worker's config with a quantized KV cache: the plugin's check must refuse it here too."""
    import copy

    bad = copy.copy(vllm_config)
    bad.model_config = copy.copy(vllm_config.model_config)
    bad.cache_config = copy.copy(vllm_config.cache_config)
    bad.model_config.config_updated = False
    bad.cache_config.cache_dtype = "fp8"
    try:
        bad.try_verify_and_update_config()
    except ValueError as e:
        return str(e)
    return None


def probe(worker) -> dict:
    """What the plugin left in this worker process by the time vLLM initializes its device."""
    out = {"installed_before_worker_cls": _installed_before_worker_cls}
    import vllm.plugins

    out["plugins_loaded"] = vllm.plugins.plugins_loaded
    out["entry_points"] = sorted(
        f"{ep.name} = {ep.value}" for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))
    pc = worker.parallel_config
    out["rank"], out["local_rank"] = worker.rank, worker.local_rank
    out["node_rank"], out["nnodes"] = pc.node_rank, pc.nnodes
    out["world_size"], out["local_world_size"] = pc.world_size, pc.local_world_size
    out["tp"], out["pcp"] = pc.tensor_parallel_size, pc.prefill_context_parallel_size
    out["architectures"] = list(worker.model_config.architectures)
    out["additional_config"] = dict(worker.vllm_config.additional_config or {})
    out["first"] = _plugin_state(worker)

    # installing again changes nothing: vLLM's loader once more (its own guard makes it a no-op), the
    # loader with its guard reset (the entry point runs register() again), register() and install()
    import qwen36_pcp
    from qwen36_pcp import patches

    vllm.plugins.load_general_plugins()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    qwen36_pcp.register()
    patches._installed = False  # past install()'s own guard: every patch meets its own wrapper
    patches.install()
    out["intended"] = sorted(p.target for p in patches.PATCHES)
    out["again"] = _plugin_state(worker)
    out["rejected"] = _rejected_in_worker(worker.vllm_config)
    # uninstall puts vLLM's own functions back, and install wraps them again
    originals = {p.target: id(p.original()) for p in patches.PATCHES}
    patches.uninstall()
    out["uninstalled"] = {"hooks": _hooks_in_process(),
                          "originals_back": all(id(inspect.getattr_static(p.owner, p.name).__func__
                                                   if isinstance(inspect.getattr_static(p.owner, p.name), staticmethod)
                                                   else inspect.getattr_static(p.owner, p.name)) == originals[p.target]
                                                for p in patches.PATCHES),
                          "config_check": _plugin_state(worker)["config_check"]}
    patches.install()
    out["reinstalled"] = sorted(_hooks_in_process())
    return out


class ProbeDone(RuntimeError):
    """Raised by the probe worker's init_device once it has written what it found."""


def _await_the_nodes_probes(probe_dir: Path, local_world_size: int, timeout: float = 120.0) -> None:
    """Returns once every worker of this node has written its probe (or after ``timeout``): vLLM's
    launcher ends all of a node's workers as soon as one fails to start, so a probe that stopped first
    would cut off a sibling still importing (one that never writes leaves its file missing: the test
    fails on that)."""
    deadline = time.monotonic() + timeout
    while len(list(probe_dir.glob("worker*.json"))) < local_world_size and time.monotonic() < deadline:
        time.sleep(0.1)


_probe_worker = None
_installed_before_worker_cls = None


def __getattr__(name):  # ``tests.test_worker_start.ProbeWorker``, built only where vLLM asks for it
    global _probe_worker, _installed_before_worker_cls
    if name != "ProbeWorker":
        raise AttributeError(name)
    if _probe_worker is None:
        # vLLM resolves the worker class right after load_general_plugins(): was install() done by then?
        hooks = sys.modules.get("qwen36_pcp.patches")
        _installed_before_worker_cls = bool(hooks is not None and hooks._installed)
        from qwen36_pcp.worker import PCPWorker

        class ProbeWorker(PCPWorker):
            def init_device(self):
                path = Path(os.environ[PROBE_DIR_ENV]) / f"worker{self.rank}.json"
                try:
                    result = probe(self)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    import traceback

                    result = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
                path.write_text(json.dumps(result))
                _await_the_nodes_probes(path.parent, self.parallel_config.local_world_size)
                raise ProbeDone("probe written: the worker stops before building its model")

        _probe_worker = ProbeWorker
    return _probe_worker


# ========================================================== the launcher on node 1 (python -c)
LAUNCHER = r"""
import json, os, sys
from tests.fake_cuda import use_fake_cuda

use_fake_cuda()  # the launcher's stand-in for the CUDA platform; the workers get none
import vllm.platforms as platforms

# a GPU node's launcher: not vLLM's CPU backend (which would pin OpenMP threads of CPU workers)
type(platforms._current_platform).is_cpu = lambda self: False

ckpt, out_dir = sys.argv[1], sys.argv[2]
SERVE = ["vllm", "serve", ckpt, "--hf-overrides", '{"architectures": ["Qwen3_6ForCausalLM"]}',
         "-tp", "2", "-pcp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--headless", "--max-model-len", "4096", "--load-format", "dummy"]


def serve(*extra):
    # the ``vllm`` console script: vllm.entrypoints.cli.main:main
    from vllm.entrypoints.cli.main import main

    sys.argv = SERVE + list(extra)
    try:
        main()
    except BaseException as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


result = {}
result["fp8_kv_cache"] = serve("--kv-cache-dtype", "fp8")
type(platforms._current_platform).device_count = classmethod(lambda cls: 1)
result["one_gpu"] = serve()
type(platforms._current_platform).device_count = classmethod(lambda cls: 2)
result["workers"] = serve("--worker-cls", "%(probe)s")
result["start_method"] = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
with open(os.path.join(out_dir, "launcher.json"), "w") as f:
    json.dump(result, f)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # skip vLLM's interpreter teardown
""" % {"probe": PROBE_WORKER}  # noqa: UP031 (a program's text: its braces are its own)


def _run(args, env, timeout):
    """Run a fresh interpreter in its own process group; on timeout end that group (its workers)."""
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{args[:3]} did not finish in {timeout} s:\n{output[-6000:]}")
    return proc.returncode, output


@pytest.fixture(scope="module")
def node1(tmp_path_factory):
    """Run node 1's ``vllm serve --headless`` with the probe worker; returns (launcher, workers)."""
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    tmp = tmp_path_factory.mktemp("node1")
    ckpt = make_checkpoint(tmp / "tiny", preset="tiny", config_only=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "QWEN36_PCP_"))}
    env.update({PROBE_DIR_ENV: str(tmp), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                "VLLM_LOGGING_LEVEL": "WARNING"})
    rc, output = _run([sys.executable, "-c", LAUNCHER, str(ckpt), str(tmp)], env, TIMEOUT_S)
    launcher = tmp / "launcher.json"
    assert rc == 0 and launcher.exists(), f"launcher exited {rc}:\n{output[-6000:]}"
    workers = {p.name: json.loads(p.read_text()) for p in sorted(tmp.glob("worker*.json"))}
    return json.loads(launcher.read_text()), workers, output


def test_entry_point_is_discoverable():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "qwen36_pcp = qwen36_pcp:register" in {f"{ep.name} = {ep.value}" for ep in eps}


def test_headless_node_checks_its_own_config(node1):
    """Node 1 builds its own VllmConfig from its command line: the plugin's startup checks run there,
    and the GPU check counts this node's ranks (tp x pcp / nnodes = 2), not the world's 4."""
    launcher, _, output = node1
    assert "qwen36_pcp" in (launcher["fp8_kv_cache"] or ""), launcher["fp8_kv_cache"]
    assert "quantized KV cache (kv_cache_dtype=fp8" in launcher["fp8_kv_cache"]
    assert "1 visible GPU(s)" in (launcher["one_gpu"] or ""), launcher["one_gpu"]
    assert "= 2 ranks on this node" in launcher["one_gpu"]
    # the run with the probe worker fails only because the workers stop at init_device
    assert "WorkerProc initialization failed" in (launcher["workers"] or ""), (launcher, output[-6000:])
    assert launcher["start_method"] == "spawn"  # set by the vllm CLI: every worker is a new interpreter


def test_spawned_workers_have_the_plugin_installed_once(node1):
    _, workers, output = node1
    # node 1 runs global ranks 2 and 3: PCP rank 1's whole TP group (vLLM's layout puts TP fastest,
    # tests/test_layouts_cpu.py), so TP stays inside a node and only PCP crosses nodes
    assert sorted(workers) == ["worker2.json", "worker3.json"], output[-6000:]
    for name, w in workers.items():
        assert "error" not in w, (name, w.get("tb"))
        assert (w["node_rank"], w["nnodes"], w["world_size"], w["local_world_size"]) == (1, 2, 4, 2)
        assert (w["tp"], w["pcp"], w["local_rank"]) == (2, 2, w["rank"] - 2)
        assert w["architectures"] == [ARCH]
        # installed by vLLM's loader, from the entry point, before the worker class was resolved
        assert w["installed_before_worker_cls"] and w["plugins_loaded"]
        assert "qwen36_pcp = qwen36_pcp:register" in w["entry_points"]
        first = w["first"]
        assert first["registered"], name
        assert first["model_cls"] == "qwen36_pcp.model.qwen3_6.Qwen3_6ForCausalLM"
        assert first["config_check"] == "qwen36_pcp.patches._config_check_class.<locals>.Qwen36PCPConfig"
        # every hook install() makes is in place, and nothing else carries its mark
        assert set(first["hooks"]) == HOOKS, set(first["hooks"]) ^ HOOKS
        assert set(w["intended"]) == set(first["hooks"]), set(w["intended"]) ^ set(first["hooks"])
        assert not any(h["twice"] for h in first["hooks"].values()), first["hooks"]
        # installing again changed nothing: the same wrappers, each wrapping vLLM's function once
        assert w["again"] == first, (w["again"], first)
        # the startup check is live in the worker too, and node 1's config went through it
        assert w["rejected"] and "qwen36_pcp" in w["rejected"] and "kv_cache_dtype=fp8" in w["rejected"]
        assert w["additional_config"].get("gdn_prefill_backend") == "triton"
        # uninstall: no mark left, vLLM's own functions and config map back; install again: as first
        assert w["uninstalled"] == {"hooks": {}, "originals_back": True, "config_check": None}, w["uninstalled"]
        assert w["reinstalled"] == sorted(first["hooks"])
