"""N PCP ranks replayed in one process on one GPU: each rank a thread, collectives through a barrier.

``replay(fn, world_size, *args)`` runs ``fn(rank, group, *args)`` for every rank and returns the results
in rank order. Only one rank runs at a time (a rank hands the GPU on when it waits in a collective), so
the kernels each rank launches are the ones it would launch on its own GPU, with its own shapes, in a
fixed order; an all-gather is a concatenation of the ranks' tensors, the same bytes NCCL would move.
"""

from __future__ import annotations

import threading

import torch


class ReplayGroup:
    """The ``all_gather`` and ``broadcast`` contracts of vLLM's GroupCoordinator for one replayed rank."""

    def __init__(self, shared: _Shared, rank: int):
        self._shared, self.rank_in_group, self.world_size = shared, rank, shared.world_size

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        s = self._shared
        s.slots[self.rank_in_group] = x.contiguous()
        s.turn.release()  # let the other ranks run up to the same collective
        try:
            s.barrier.wait()
            out = torch.cat(s.slots, dim=dim)
            s.barrier.wait()  # every rank has its copy before the slots are reused
        finally:
            s.turn.acquire()
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.all_gather(x[None])[src]


class _Shared:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size)
        self.turn = threading.Lock()


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
