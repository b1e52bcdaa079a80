# SPDX-License-Identifier: Apache-2.0
"""Every rank of an engine on GPU 0: pcp=2 engines on a 1-GPU machine (check runs and profiles).

NCCL refuses two ranks on one device ("Duplicate GPU detected", NCCL 2.28.9 on H200). An engine
built with ``worker_cls="harness.shared_gpu.SharedGPUWorker"`` and
``distributed_executor_backend="mp"`` puts every worker on GPU 0 and moves its collectives through
host memory over gloo. The worker builds on the plugin's ``PCPWorker`` (the PCP model runner at
pcp > 1, vLLM's at pcp == 1). Gathers, broadcasts and point-to-point copies move the same bytes as NCCL, so a
pcp=2 engine computes here exactly what it computes on two GPUs; only its speed differs. Sums are
taken in fp32 on the host, not in NCCL's order: a tp=2 engine here is compared only with another
engine summed the same way (tp=2 x pcp=2 against tp=2), not with tp=2 over NCCL.

Building the worker (in each worker process) switches the CUDA platform to these communicators before
the worker joins the distributed world; importing this module changes nothing (the plugin's config
check imports it in the front end to see what the worker class builds on).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.platforms import current_platform

from qwen36_pcp.worker import PCPWorker

TURNS_ENV = "QWEN36_PCP_SHARED_TURNS"


class Turns:
    """With ``QWEN36_PCP_SHARED_TURNS=<lock file>``, one rank at a time on the shared GPU.

    A rank holds the lock while it runs a step and gives it up (after its kernels finished) while it
    waits in a collective, so every kernel runs alone on the GPU, as on a GPU of its own: a profiler's
    kernel times per rank are then those of N GPUs (benchmarks/profile_prefill.py ``--shared-gpu``).
    Within a step ranks wait for each other only in collectives: the communicator's below, and
    GroupCoordinator's own on its gloo groups (``_pause_in_group_collectives``), so taking turns does
    not deadlock.
    """

    fd: int | None = None
    held = False
    held_s = 0.0  # time this rank has held the GPU (``turn_seconds``)
    staged_s = 0.0  # of it, in collectives' copies through host memory
    drained_s = 0.0  # of it, waiting for its queued GPU work to finish (at a collective or the turn's end)
    _since = 0.0
    _paused_s = 0.0  # time spent in ``paused`` so far
    _pausing = False
    _staging_depth = 0

    @classmethod
    def open(cls) -> None:
        path = os.environ.get(TURNS_ENV)
        if path and cls.fd is None:
            cls.fd = os.open(path, os.O_CREAT | os.O_RDWR)

    @classmethod
    def take(cls) -> bool:
        if cls.fd is None or cls.held:
            return False
        fcntl.flock(cls.fd, fcntl.LOCK_EX)
        cls.held, cls._since = True, time.perf_counter()
        return True

    @classmethod
    def _drain(cls) -> None:
        t0 = time.perf_counter()
        _synchronize()
        cls.drained_s += time.perf_counter() - t0

    @classmethod
    def give(cls) -> None:
        if cls.held:
            cls._drain()
            cls.held_s += time.perf_counter() - cls._since
            fcntl.flock(cls.fd, fcntl.LOCK_UN)
            cls.held = False

    @classmethod
    @contextlib.contextmanager
    def turn(cls):
        """Around a step: the rank holds a turn while it runs (inside another turn, that one)."""
        taken = cls.take()
        try:
            yield
        finally:
            if taken:
                cls.give()

    @classmethod
    @contextlib.contextmanager
    def paused(cls):
        """Around a collective: the other ranks run until they reach it too."""
        held, t0, outer = cls.held, time.perf_counter(), not cls._pausing
        cls._pausing = True
        cls.give()
        try:
            yield
        finally:
            if held:
                cls.take()
            if outer:  # a pause inside another (broadcast_tensor_dict's broadcast_object) is counted once
                cls._pausing = False
                cls._paused_s += time.perf_counter() - t0

    @classmethod
    def staging(cls, collective):
        """Around a collective of ``HostStagedCommunicator``: its copies through host memory (the
        device-to-host and host-to-device copies, the host's concatenation or sum), which NCCL does not
        make, are added to ``staged_s``. The GPU's queued work is drained first (the rank's own kernels,
        part of its step on a GPU of its own: ``drained_s``) and the wait for the other ranks is left
        out. With turns, only inside one: a collective outside a turn is no rank's step."""

        @functools.wraps(collective)
        def staged(*args, **kwargs):
            if cls._staging_depth or (cls.fd is not None and not cls.held):  # inside another collective
                return collective(*args, **kwargs)  # (``gather`` is an all-gather), or outside a turn
            cls._drain()
            t0, paused0 = time.perf_counter(), cls._paused_s
            cls._staging_depth += 1
            try:
                return collective(*args, **kwargs)
            finally:
                cls._staging_depth -= 1
                _synchronize()
                cls.staged_s += time.perf_counter() - t0 - (cls._paused_s - paused0)

        return staged


def host_busy_s() -> float:
    """This rank's host busy inside its turns so far (``turn - staging - drain`` of ``turn_counters``,
    the turn it holds now counted up to this moment): the difference of two readings is the host's own
    time between them, its waits for the GPU, its collectives' copies and its waits for the other ranks
    left out. Without turns: the wall clock."""
    if Turns.fd is None:
        return time.perf_counter()
    held = Turns.held_s + (time.perf_counter() - Turns._since if Turns.held else 0.0)
    return held - Turns.staged_s - Turns.drained_s


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def turn_seconds(worker=None) -> float:
    """The time this worker's rank has held the shared GPU so far (a ``collective_rpc`` target): its
    steps' own host and GPU time, as on a GPU of its own, without the time it waited in collectives."""
    return Turns.held_s


def turn_counters(worker=None) -> dict[str, float]:
    """This worker's rank's time so far (a ``collective_rpc`` target), in seconds: ``turn`` (its turns,
    ``turn_seconds``); of it ``staging``, copying its collectives through host memory (what NCCL between
    GPUs would not spend), and ``drain``, the host waiting for the rank's queued GPU work (at a
    collective or the turn's end: the GPU's work the host's did not overlap). The rest of the turn,
    ``turn - staging - drain``, is the host busy inside its turns, kernels running beside it."""
    return {"turn": Turns.held_s, "staging": Turns.staged_s, "drain": Turns.drained_s}


class HostStagedCommunicator(DeviceCommunicatorBase):
    """DeviceCommunicatorBase's collectives through host memory on the group's gloo group.

    The GPU only copies to and from the host (no kernel of its own: sums, concatenation and casts run
    on the host), so a profile tells these copies from the model's kernels by their kind."""

    @staticmethod
    def _host(x: torch.Tensor) -> torch.Tensor:
        # exact copies of any dtype: move raw bytes
        return x.detach().contiguous().cpu().reshape(-1).view(torch.uint8)

    def _gather_host(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, on the host."""
        raw = self._host(x)
        parts = [torch.empty_like(raw) for _ in range(self.world_size)]
        with Turns.paused():
            dist.all_gather(parts, raw, group=self.cpu_group)
        return [p.view(x.dtype).reshape(x.shape) for p in parts]

    @Turns.staging
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._gather_host(input_), dim=dim % input_.dim()).to(input_.device)

    @Turns.staging
    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        out = self.all_gather(input_, dim)
        return out if self.rank_in_group == dst else None

    def _sum_host(self, x: torch.Tensor) -> torch.Tensor:
        """The group's sum of ``x`` in fp32 on the host, cast back to ``x``'s dtype."""
        host = x.detach().cpu().float()
        with Turns.paused():
            dist.all_reduce(host, group=self.cpu_group)
        return host.to(x.dtype)

    @Turns.staging
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        input_.copy_(self._sum_host(input_))
        return input_

    @Turns.staging
    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        summed = self._sum_host(input_)
        part = summed.chunk(self.world_size, dim=dim % input_.dim())[self.rank_in_group]
        return part.contiguous().to(input_.device)

    @Turns.staging
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        raw = self._host(tensor)
        with Turns.paused():
            dist.broadcast(raw, self.ranks[src], group=self.cpu_group)
        tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape))
        return tensor

    @Turns.staging
    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        raw = self._host(tensor)
        with Turns.paused():
            dist.send(raw, self.ranks[dst], group=self.cpu_group)

    @Turns.staging
    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        raw = torch.empty(math.prod(size) * dtype.itemsize, dtype=torch.uint8)
        with Turns.paused():
            dist.recv(raw, self.ranks[src], group=self.cpu_group)
        return raw.view(dtype).reshape(size).to(self.device)


class SharedGPUWorker(PCPWorker):
    """The PCP worker on GPU 0 whatever its local rank, its collectives through the host."""

    def __init__(self, *args, **kwargs):
        use_host_staged_collectives()
        super().__init__(*args, **kwargs)

    def init_device(self):
        real_count = torch.accelerator.device_count
        self.local_rank %= real_count()
        if self.parallel_config.nnodes_within_dp > 1:
            # several "nodes" on this machine: vLLM tells a peer on this node from one on another by
            # rank // device_count() (MessageQueue.create_from_process_group_single_reader)
            local = self.parallel_config.local_world_size
            type(current_platform).device_count = classmethod(lambda cls: local)
        # init_device asserts one visible GPU per local rank
        torch.accelerator.device_count = lambda: max(real_count(), self.parallel_config.local_world_size)
        try:
            super().init_device()
        finally:
            torch.accelerator.device_count = real_count
        Turns.open()
        record_step_kinds(self)

    def execute_model(self, scheduler_output):
        with Turns.turn():
            return super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        with Turns.turn():
            out = super().sample_tokens(grammar_output)
        record_drafts(self)
        return out


DRAFTS_ENV = "QWEN36_PCP_RECORD_DRAFTS"


def record_drafts(worker) -> None:
    """With ``QWEN36_PCP_RECORD_DRAFTS=<file>``, each rank appends each step's speculative drafts (the
    tokens it feeds into its next step) to ``<file>.<rank>`` as a JSON line {request id: [draft ids]}:
    engines are compared draft for draft, which the answers alone cannot show (a rejected draft leaves
    no trace), and the ranks of one engine with each other (only rank 0 reports tokens, so ranks that
    fed different drafts would go unseen in the answers)."""
    path = os.environ.get(DRAFTS_ENV)
    runner = worker.model_runner
    drafts = getattr(runner, "_draft_token_ids", None)
    if not path or not isinstance(drafts, torch.Tensor):
        return
    req_ids = runner.input_batch.req_ids[: drafts.shape[0]]
    with open(f"{path}.{worker.rank}", "a") as f:
        f.write(json.dumps(dict(zip(req_ids, drafts.tolist()))) + "\n")


STEPS_ENV = "QWEN36_PCP_RECORD_STEPS"


class StepRecordingWorker(PCPWorker):
    """The plugin's worker on GPUs of their own, recording its step kinds (``record_step_kinds``)."""

    def init_device(self):
        super().init_device()
        record_step_kinds(self)


LONG_PROMPT = 8192  # tokens: a prompt this long or longer counts as long in the step records


def record_step_kinds(worker) -> None:
    """With ``QWEN36_PCP_RECORD_STEPS=<file>``, each rank appends the kind of each model forward to
    ``<file>.<rank>``, one per line: ``whole`` (an unsplit step), ``owned_full`` / ``owned_piecewise`` /
    ``owned_none`` (a spread decode step: the rank's own requests as vLLM's batch, under that CUDA graph
    mode), ``split_verify`` (a planned step with verification rows: drafts verified beside a prompt) or
    ``split`` (any other planned step), and ``handover`` before a step whose requests' GDN states go from
    their owners to every rank first (spread with MTP): a test sees which path the steps took, which the
    answers alone cannot show. A forward's line also counts its tokens (``step_tokens``): ``prompt=``
    the prompt tokens it computes, ``split=`` those of split requests, ``long=`` / ``long_split=`` the
    same of prompts of ``LONG_PROMPT`` tokens or more, ``verify=`` its verification rows."""
    path = os.environ.get(STEPS_ENV)
    runner = getattr(worker, "model_runner", None)
    if not path or runner is None:
        return

    def recorded(*args, **kwargs):
        from vllm.forward_context import get_forward_context

        step = getattr(runner, "pcp_step", None)
        plan = None if step is None else step.plan
        kind = ("whole" if plan is None else
                ("split_verify" if plan.verify.any() else "split") if step.owned is None
                else f"owned_{get_forward_context().cudagraph_runtime_mode.name.lower()}")
        with open(f"{path}.{worker.rank}", "a") as f:
            f.write(f"{kind} {_step_tokens(runner, plan)}\n")
        # looked up on each call: whatever wraps the class's method later (``host_phases``) still runs
        return type(runner)._model_forward(runner, *args, **kwargs)

    def handed_over(handover):
        if (handover >= 0).any():
            with open(f"{path}.{worker.rank}", "a") as f:
                f.write("handover\n")
        return type(spread).hand_over_states(spread, handover)

    runner._model_forward = recorded
    spread = getattr(runner, "spread", None)
    if spread is not None:
        spread.hand_over_states = handed_over


def _step_tokens(runner, plan) -> str:
    """A forward's token counts (``record_step_kinds``), from what the runner holds on the host."""
    import numpy as np

    batch = getattr(runner, "input_batch", None)
    n = getattr(batch, "num_reqs", None)
    if n is None or not hasattr(batch, "num_prompt_tokens"):  # (a stand-in runner)
        return ""
    num_new = np.diff(runner.query_start_loc.np[: n + 1]).astype(np.int64)
    num_prompt = batch.num_prompt_tokens[:n].astype(np.int64)
    prompt = np.clip(num_prompt - batch.num_computed_tokens_cpu[:n], 0, num_new)
    split = plan.split if plan is not None else np.zeros(n, dtype=bool)
    verify = plan.num_new[plan.verify].sum() if plan is not None else 0
    long = num_prompt >= LONG_PROMPT
    return (f"prompt={prompt.sum()} split={prompt[split].sum()} long={prompt[long].sum()} "
            f"long_split={prompt[long & split].sum()} verify={verify}")


def read_step_kinds(path) -> list[dict]:
    """Per rank, how many model forwards of each kind ``record_step_kinds`` wrote to ``<path>.<rank>``."""
    from collections import Counter

    return [dict(Counter(line.split()[0] for line in lines if line)) for lines in _step_lines(path)]


def read_step_tokens(path) -> list[dict]:
    """Per rank, per kind, the token counts ``record_step_kinds`` wrote, summed."""
    out = []
    for lines in _step_lines(path):
        sums: dict[str, dict[str, int]] = {}
        for line in lines:
            kind, *fields = line.split()
            kind_sums = sums.setdefault(kind, {})
            for field in fields:
                key, value = field.split("=")
                kind_sums[key] = kind_sums.get(key, 0) + int(value)
        out.append(sums)
    return out


def _step_lines(path) -> list[list[str]]:
    from pathlib import Path

    path = Path(path)
    return [f.read_text().splitlines() for f in sorted(path.parent.glob(path.name + ".*"))]


_host_staged = False


def use_host_staged_collectives() -> None:
    """In this (worker) process: the platform's device communicator is ``HostStagedCommunicator`` over
    gloo, and GroupCoordinator's own collectives give up the turn while they wait. Once per process."""
    global _host_staged
    if _host_staged:
        return
    _host_staged = True
    _pause_in_group_collectives()
    type(current_platform).dist_backend = "gloo"
    type(current_platform).get_device_communicator_cls = classmethod(
        lambda cls: f"{__name__}.HostStagedCommunicator")


def _pause_in_group_collectives() -> None:
    """GroupCoordinator's collectives that bypass the device communicator wait for the other ranks
    without holding a turn. Its tensor broadcast goes through the communicator (a copy to the host on
    every rank, as the other collectives: a profile then splits every rank's step at the same points)."""
    vllm_broadcast = GroupCoordinator.broadcast

    def broadcast(self, input_: torch.Tensor, src: int = 0):
        if self.world_size > 1 and isinstance(self.device_communicator, HostStagedCommunicator):
            return self.device_communicator.broadcast(input_, src)
        with Turns.paused():
            return vllm_broadcast(self, input_, src)

    def paused(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with Turns.paused():
                return fn(*args, **kwargs)
        return wrapper

    GroupCoordinator.broadcast = broadcast
    for name in ("broadcast_object", "broadcast_object_list", "broadcast_tensor_dict", "barrier",
                 "send_object", "recv_object", "send_tensor_dict", "recv_tensor_dict"):
        setattr(GroupCoordinator, name, paused(getattr(GroupCoordinator, name)))

