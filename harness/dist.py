# SPDX-License-Identifier: Apache-2.0
"""Run a function on N processes as a PCP group (layer tests and benchmarks).

CPU (gloo): the group is vLLM's own GroupCoordinator, exactly the class ``get_pcp_group()`` returns.
GPU (nccl): a thin torch.distributed adapter with the same ``all_gather`` contract (vLLM's CUDA
communicator needs the whole engine's distributed setup).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchDistGroup:
    """GroupCoordinator's all_gather, broadcast, all_reduce, send and recv contracts over the default
    torch.distributed group."""

    def __init__(self):
        import torch.distributed as dist

        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()

    def all_gather(self, x, dim=0):
        import torch
        import torch.distributed as dist

        assert dim == 0
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    def broadcast(self, x, src=0):
        import torch.distributed as dist

        dist.broadcast(x, src=src)
        return x

    def all_reduce(self, x):
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out)
        return out

    def send(self, x, dst):
        import torch.distributed as dist

        dist.send(x.contiguous(), dst)

    def recv(self, size, dtype, src):
        import torch
        import torch.distributed as dist

        out = torch.empty(size, dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
        dist.recv(out, src)
        return out


def _by_value(result) -> bytes:
    """The result pickled with its tensors' data: through torch's queue a tensor travels as a handle to
    the child's shared memory, which is gone once the child has exited before the parent reads it."""
    return pickle.dumps(result)


def _worker(rank, world_size, port, fn, args, queue, backend):
    try:
        import torch
        import torch.distributed as dist

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                    device_id=torch.device("cuda", rank))
            group = TorchDistGroup()
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
            from vllm.distributed.parallel_state import GroupCoordinator

            group = GroupCoordinator(
                [list(range(world_size))],
                local_rank=rank,
                torch_distributed_backend="gloo",
                use_device_communicator=True,
                group_name=f"pcp_test_{world_size}",
            )
        result = fn(rank, group, *args)
        queue.put((rank, "ok", _by_value(result)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))


# Importing vLLM takes ~13 CPU seconds, and 8 ranks on 2 cores would spend a minute on it: the gloo ranks
# are forked from one server process that has imported vLLM's process-group module and the plugin's
# runner (with its layers and vLLM's model runner: ~4 more CPU seconds a rank would pay) once; it does
# nothing else, so every rank starts clean. NCCL ranks are spawned (CUDA does not survive a fork).
_PRELOAD = ["vllm.config", "vllm.distributed.parallel_state", "qwen36_pcp.runner_hooks", "harness.shared_gpu",
            "harness.dist"]


def _context(backend: str):
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_gloo_server() -> None:
    """Start the gloo ranks' server now (it imports in the background; the first run waits for it)."""
    from multiprocessing import forkserver

    _context("gloo")
    forkserver.ensure_running()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, group, *args)`` on ``world_size`` processes; returns the per-rank results."""
    ctx = _context(backend)
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def _isolated(fn, args, queue):
    try:
        queue.put(("ok", _by_value(fn(*args))))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def run_isolated(fn, *args, timeout: float = 600.0):
    """Run ``fn(*args)`` in a fresh spawned process (process-global vLLM state stays out of pytest)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_isolated, args=(fn, args, queue), daemon=True)
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status == "error":
        raise AssertionError(f"isolated run failed:\n{payload}")
    return pickle.loads(payload)


def error_of(fn) -> str | None:
    """``"ExceptionType: message"`` of what ``fn()`` raises (SystemExit included: vLLM's CLI exits on a
    bad argument), or None: for tests of the message a refused config or command ends with."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the message is what is tested
        return f"{type(e).__name__}: {e}"
    return None
