"""Every rank of an engine on GPU 0: pcp=2 engines on a 1-GPU machine (a check run, tests only).

NCCL refuses two ranks on one device ("Duplicate GPU detected", NCCL 2.28.9 on H200). An engine
built with ``worker_cls="tests.gpu.shared_gpu.SharedGPUWorker"`` and
``distributed_executor_backend="mp"`` puts every worker on GPU 0 and moves its collectives through
host memory over gloo. Gathers, broadcasts and point-to-point copies move the same bytes as NCCL, so a
pcp=2 engine computes here exactly what it computes on two GPUs; only its speed differs. Sums are
taken in fp32 on the host, not in NCCL's order: a tp=2 engine here is compared only with another
engine summed the same way (tp=2 x pcp=2 against tp=2), not with tp=2 over NCCL.

Importing this module (which vLLM does in each worker process, to find the worker class) switches
the CUDA platform to these communicators before the worker joins the distributed world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.platforms import current_platform
from vllm.v1.worker.gpu_worker import Worker


class HostStagedCommunicator(DeviceCommunicatorBase):
    """DeviceCommunicatorBase's collectives through host memory on the group's gloo group."""

    def _host(self, x: torch.Tensor) -> torch.Tensor:
        # exact copies of any dtype: move raw bytes
        return x.detach().contiguous().cpu().reshape(-1).view(torch.uint8)

    def _back(self, raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return raw.view(like.dtype).reshape(like.shape).to(like.device)

    def _gather_list(self, x: torch.Tensor) -> list[torch.Tensor]:
        raw = self._host(x)
        parts = [torch.empty_like(raw) for _ in range(self.world_size)]
        dist.all_gather(parts, raw, group=self.cpu_group)
        return [self._back(p, x) for p in parts]

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._gather_list(input_), dim=dim % input_.dim())

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        out = self.all_gather(input_, dim)
        return out if self.rank_in_group == dst else None

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        host = input_.detach().float().cpu()
        dist.all_reduce(host, group=self.cpu_group)
        input_.copy_(host.to(input_.device, input_.dtype))
        return input_

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        summed = self.all_reduce(input_.clone())
        return summed.chunk(self.world_size, dim=dim % input_.dim())[self.rank_in_group].contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        raw = self._host(tensor)
        dist.broadcast(raw, self.ranks[src], group=self.cpu_group)
        tensor.copy_(self._back(raw, tensor))
        return tensor

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        dist.send(self._host(tensor), self.ranks[dst], group=self.cpu_group)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        like = torch.empty(size, dtype=dtype, device=self.device)
        raw = self._host(like)
        dist.recv(raw, self.ranks[src], group=self.cpu_group)
        return self._back(raw, like)


class SharedGPUWorker(Worker):
    """vLLM's GPU worker on GPU 0 whatever its local rank."""

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


type(current_platform).dist_backend = "gloo"
type(current_platform).get_device_communicator_cls = classmethod(
    lambda cls: f"{__name__}.HostStagedCommunicator")
