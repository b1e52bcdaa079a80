# SPDX-License-Identifier: Apache-2.0
"""N PCP ranks replayed in one process on one GPU: each rank a thread, collectives through a barrier.

``replay(fn, world_size, *args)`` runs ``fn(rank, group, *args)`` for every rank and returns the results
in rank order. Only one rank runs at a time (a rank hands the GPU on when it waits in a collective), so
each rank launches the kernels of its own shapes, in a fixed order; an all-gather is a concatenation of
the ranks' tensors, the same bytes NCCL would move; a send is a copy into the receiver's mailbox. The
ranks share one process, so they share Triton's autotuning choices (separate GPUs make their own).
Every collective checks that all ranks called the same one with the same shape and dtype, as NCCL
needs (a recv, that the send matches it), and a rank that never arrives fails the others after
``TIMEOUT_S`` instead of hanging them.
"""

from __future__ import annotations

import collections
import threading

import torch

TIMEOUT_S = 600


class ReplayGroup:
    """The ``all_gather``, ``broadcast``, ``all_reduce``, ``send`` and ``recv`` contracts of vLLM's
    GroupCoordinator for one replayed rank."""

    def __init__(self, shared: _Shared, rank: int):
        self._shared, self.rank_in_group, self.world_size = shared, rank, shared.world_size

    def _exchange(self, op: str, x: torch.Tensor) -> list[torch.Tensor]:
        s = self._shared
        s.slots[self.rank_in_group] = (op, tuple(x.shape), x.dtype, x.contiguous())
        s.turn.release()  # let the other ranks run up to the same collective
        try:
            s.barrier.wait()
            calls = {slot[:3] for slot in s.slots}
            if len(calls) != 1:
                raise AssertionError(f"ranks called different collectives: {sorted(map(str, calls))}")
            parts = [slot[3] for slot in s.slots]
            s.barrier.wait()  # every rank has its parts before the slots are reused
        finally:
            s.turn.acquire()
        return parts

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat(self._exchange("all_gather", x), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._exchange(f"broadcast from {src}", x)[src].clone()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors summed in rank order (NCCL's order between GPUs is its own)."""
        parts = self._exchange("all_reduce", x)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        s = self._shared
        with s.mail_arrived:
            s.mail[(self.rank_in_group, dst)].append(x.contiguous().clone())
            s.mail_arrived.notify_all()

    def recv(self, size, dtype, src: int) -> torch.Tensor:
        s, box = self._shared, (src, self.rank_in_group)
        s.turn.release()  # the sender runs until it sends
        try:
            with s.mail_arrived:
                if not s.mail_arrived.wait_for(lambda: s.mail[box] or s.barrier.broken, timeout=TIMEOUT_S):
                    raise TimeoutError(f"rank {self.rank_in_group}: nothing from rank {src} in {TIMEOUT_S} s")
                if s.barrier.broken:
                    raise threading.BrokenBarrierError
                x = s.mail[box].pop(0)
        finally:
            s.turn.acquire()
        if tuple(x.shape) != tuple(size) or x.dtype != dtype:
            raise AssertionError(f"rank {src} sent {tuple(x.shape)} {x.dtype}, rank {self.rank_in_group} "
                                 f"expected {tuple(size)} {dtype}")
        return x


class _Shared:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=TIMEOUT_S)
        self.turn = threading.Lock()
        self.mail: dict = collections.defaultdict(list)  # (src, dst) -> tensors sent, not yet received
        self.mail_arrived = threading.Condition()


def replay(fn, world_size: int, *args) -> list:
    shared = _Shared(world_size)
    results: list = [None] * world_size
    errors: list = []

    def run(rank):
        shared.turn.acquire()
        try:
            results[rank] = fn(rank, ReplayGroup(shared, rank), *args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append((rank, e))
            shared.barrier.abort()  # the other ranks stop waiting for this one
            with shared.mail_arrived:
                shared.mail_arrived.notify_all()
        finally:
            shared.turn.release()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [(r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        rank, err = (real or errors)[0]
        raise RuntimeError(f"replayed rank {rank} failed") from err
    return results
