# SPDX-License-Identifier: Apache-2.0
"""Build vLLM configs and models on a machine without a GPU (tests only).

vLLM 0.20.2 imports on a CPU machine but refuses to infer a device. Pretending the platform is CUDA
(without touching any CUDA API) is enough to build a real ``VllmConfig`` for a checkpoint, construct the
model on the CPU and run its weight loader, which is what the CPU tests check. Call ``use_fake_cuda()``
first thing in a fresh process; nothing here ever runs a kernel.

``use_fake_cuda()`` must come before vLLM's config modules are imported: several of them bind
``current_platform`` at import (``vllm.config.model``, ``vllm.config.parallel``, ...), so in a process
forked from ``harness.dist``'s server (which preloads ``vllm.config``) they would keep vLLM's real
(unspecified) platform. ``RankServer`` is the cheap way to run many such processes: one spawned process
sets the fake platform up first, imports vLLM and the plugin once, and forks fresh ranks from there
(one server for a whole test run: the ``fake_cuda_ranks`` fixture of the repository's conftest.py).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

FLASH_ATTN_BACKEND = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"


def use_fake_cuda() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    if getattr(platforms._current_platform, "fake_cuda", False):
        return  # forked from a RankServer: keep the instance vLLM's modules bound (tests patch its class)

    class FakeCudaPlatform(UnspecifiedPlatform):
        device_type = "cuda"
        fake_cuda = True

        @classmethod
        def current_device(cls):
            return "cpu"

        def is_cpu(self) -> bool:  # CPU MoE method: built, never run
            return True

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return FLASH_ATTN_BACKEND

    platforms._current_platform = FakeCudaPlatform()


def engine_config(model: str, **kwargs):
    """A real VllmConfig (runs every config check, ours included)."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("max_model_len", 4096)
    return EngineArgs(model=model, **kwargs).create_engine_config()


def build_model(vllm_config, port: int = 29555, rank: int = 0, pcp_ranks: int = 1, tp: int = 1,
                as_pcp_runner: bool = True):
    """Construct the configured model class on the CPU (gloo). ``pcp_ranks`` x ``tp`` > 1: this process
    is global rank ``rank`` of a real world of that many processes, laid out by vLLM's
    ``initialize_model_parallel`` (PCP x TP, TP fastest; each process calls this with the same port).
    ``as_pcp_runner``: as the PCP model runner builds it (our model at pcp > 1 needs that)."""
    import contextlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.model_loader.utils import get_model_architecture

    from qwen36_pcp.layers.classes import pcp_model_build

    model_cls, _ = get_model_architecture(vllm_config.model_config)
    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        if not model_parallel_is_initialized():  # a second model in the process joins the same world
            init_distributed_environment(tp * pcp_ranks, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
            initialize_model_parallel(tp, 1, prefill_context_model_parallel_size=pcp_ranks, backend="gloo")
        with pcp_model_build(vllm_config) if as_pcp_runner else contextlib.nullcontext():
            return model_cls(vllm_config=vllm_config, prefix="")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a rank of the CPU tests needs, imported once in the server (children fork with it).
SERVER_PRELOAD = (
    "vllm.engine.arg_utils",
    "vllm.distributed.parallel_state",
    "vllm.model_executor.model_loader.utils",
    "vllm.v1.attention.backends.flash_attn",
    "qwen36_pcp.model.qwen3_6",
    "qwen36_pcp.layers.context",
    "vllm.v1.worker.gpu_model_runner",  # what qwen36_pcp.register() patches
    "vllm.v1.engine.core",
    "vllm.v1.core.sched.scheduler",
    "safetensors",
    # the checkpoint maker's tensor names come from these (~6 s to import: fla's kernels with them)
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)


def _rank_main(fn, rank, world_size, port, args, queue):
    try:
        import torch

        if world_size > 1:  # the ranks share the cores
            torch.set_num_threads(1)
        result = fn(rank, world_size, port, *args)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # nobody leaves (rank 0 holds the store) while another still talks
            from vllm.distributed import parallel_state

            # frees the TP groups' shared-memory broadcasters (else the resource tracker warns)
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
        queue.put((rank, "ok", result))
    except BaseException:  # report, never hang the server
        queue.put((rank, "error", traceback.format_exc()))


def _run_ranks(fn, world_size, args, timeout):
    import multiprocessing as mp
    import queue as queue_module
    import time

    ctx = mp.get_context("fork")  # from a process that only imported: no CUDA, no threads yet
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:  # killed or crashed without a word (a report would be in the queue first)
                    time.sleep(0.5)
                    if queue.empty():
                        return "error", f"rank(s) {dead} of {world_size} died: exit codes " + str(
                            [procs[r].exitcode for r in dead])
                if time.monotonic() > deadline:
                    return "error", f"timed out after {timeout} s; ranks {sorted(results)} answered"
                continue
            if status == "error":
                return "error", f"rank {rank} of {world_size} failed:\n{payload}"
            results[rank] = payload
        return "ok", [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()


def _serve(conn, preload):
    use_fake_cuda()  # before anything binds vLLM's platform
    import importlib

    for name in preload:
        importlib.import_module(name)
    import gc

    gc.freeze()  # the imported objects stay out of the children's collections (fewer copied pages)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent went away
            job = None
        if job is None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # skip the interpreter's teardown of vLLM (seconds)
        try:
            fn, world_size, args, timeout = job
            conn.send(_run_ranks(fn, world_size, args, timeout))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _isolated(rank, world_size, port, fn, args) -> bytes:
    """``RankServer.isolated``'s one process: the result pickled with its tensors' data (through the
    queue a tensor travels as a handle to this process's shared memory, gone once it has exited)."""
    import pickle

    return pickle.dumps(fn(*args))


class RankServer:
    """Fake-CUDA rank processes at the price of one vLLM import.

    A spawned server process calls ``use_fake_cuda()`` first, imports vLLM and the plugin once
    (``preload``), and then, per ``run(fn, world_size, *args)``, forks ``world_size`` fresh processes
    that each call ``fn(rank, world_size, port, *args)`` (a module-level function: it is pickled to the
    server); they may join one gloo world through ``tcp://127.0.0.1:{port}`` (``build_model`` does).
    Every run gets new processes, so vLLM's process-global state (parallel groups, the current
    config) never leaks from one run into the next. Returns the per-rank results in rank order.
    """

    def __init__(self, preload=SERVER_PRELOAD):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: a daemon may not have children; it exits when this end of the pipe closes
        self._proc = ctx.Process(target=_serve, args=(child, tuple(preload)), name="fake-cuda-ranks")
        self._proc.start()
        child.close()

    def run(self, fn, world_size: int, *args, timeout: float = 300.0) -> list:
        self._conn.send((fn, world_size, args, timeout))
        if not self._conn.poll(timeout + 60):
            self.close()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks: no answer")
        status, payload = self._conn.recv()
        if status == "error":
            raise AssertionError(payload)
        return payload

    def isolated(self, fn, *args, timeout: float = 600.0):
        """``fn(*args)`` in one fresh process (``harness.dist.run_isolated``'s contract: vLLM's
        process-global state stays out of pytest and out of the next run), without its vLLM import."""
        import pickle

        (payload,) = self.run(_isolated, 1, fn, args, timeout=timeout)
        return pickle.loads(payload)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
