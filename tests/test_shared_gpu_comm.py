# SPDX-License-Identifier: Apache-2.0
"""The host-staged communicator that lets the GPU checks run pcp=2 on one GPU moves exact bytes."""

import os
import time

import pytest
import torch

from harness.dist import run_distributed


def _collectives(rank, group):
    from harness.shared_gpu import HostStagedCommunicator

    comm = HostStagedCommunicator(group.cpu_group, device=torch.device("cpu"))
    torch.manual_seed(rank)
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    out = {"x": x, "gather0": comm.all_gather(x, 0), "gather1": comm.all_gather(x, -1),
           "bcast": comm.broadcast(x.clone(), src=1), "sum": comm.all_reduce(x.float().clone()),
           "sum_bf16": comm.all_reduce(x.clone()),
           "scatter": comm.reduce_scatter(torch.ones(4, 2) * (rank + 1), dim=0),
           "scatter_bf16_dim1": comm.reduce_scatter(x[:, :4].clone(), dim=1)}
    if rank == 0:
        comm.send(x, dst=1)
    else:
        out["recv"] = comm.recv(x.shape, x.dtype, src=0)
    return out


def test_host_staged_collectives_match_their_definitions():
    r0, r1 = run_distributed(_collectives, 2)
    for r in (r0, r1):
        assert torch.equal(r["gather0"], torch.cat([r0["x"], r1["x"]], 0))
        assert torch.equal(r["gather1"], torch.cat([r0["x"], r1["x"]], 1))
        assert torch.equal(r["bcast"], r1["x"])
        assert torch.allclose(r["sum"], r0["x"].float() + r1["x"].float())
        # bf16 sums in fp32, rounded once: the dtype stays
        assert r["sum_bf16"].dtype == torch.bfloat16
        assert torch.equal(r["sum_bf16"], (r0["x"].float() + r1["x"].float()).bfloat16())
        assert torch.equal(r["scatter"], torch.full((2, 2), 3.0))
    for rank, r in enumerate((r0, r1)):
        summed = (r0["x"][:, :4].float() + r1["x"][:, :4].float()).bfloat16()
        assert r["scatter_bf16_dim1"].dtype == torch.bfloat16
        assert torch.equal(r["scatter_bf16_dim1"], summed[:, 2 * rank: 2 * rank + 2])
    assert torch.equal(r1["recv"], r0["x"])


def _work_between_collectives(rank, group, lock):
    """Three stretches of "GPU work" (50 ms while holding a turn) with a collective after each: the
    communicator's all-gather, and GroupCoordinator's broadcasts, which do not all go through it."""
    from harness.shared_gpu import TURNS_ENV, HostStagedCommunicator, Turns, use_host_staged_collectives

    use_host_staged_collectives()  # what SharedGPUWorker does first in a worker process
    if lock:
        os.environ[TURNS_ENV] = lock
        Turns.open()
    comm = HostStagedCommunicator(group.cpu_group, device=torch.device("cpu"))
    def broadcast_through(communicator):
        group.device_communicator = communicator
        return group.broadcast(torch.full((2,), float(rank)), src=1)

    collectives = [lambda: comm.all_gather(torch.ones(2), 0),
                   lambda: group.broadcast_object(rank, src=1),      # vLLM's, on its cpu group
                   lambda: broadcast_through(None),                  # vLLM's, on its device group
                   lambda: broadcast_through(comm)]                  # the shared GPU's communicator
    spans, got = [], []
    with Turns.turn():  # one step, as SharedGPUWorker.execute_model runs it
        for collective in collectives:
            start = time.monotonic()
            time.sleep(0.05)
            spans.append((start, time.monotonic()))
            got.append(collective())
    assert got[1] == 1 and torch.equal(got[2], torch.ones(2)) and torch.equal(got[3], torch.ones(2)), got
    return spans, Turns.staged_s


@pytest.mark.parametrize("turns", [True, False])
def test_ranks_taking_turns_never_work_at_once(tmp_path, turns):
    lock = str(tmp_path / "turns.lock") if turns else ""
    (r0, staged0), (r1, staged1) = run_distributed(_work_between_collectives, 2, lock, timeout=60)
    overlaps = [(a, b) for a in r0 for b in r1 if a[0] < b[1] and b[0] < a[1]]
    assert not overlaps if turns else overlaps  # without turns both ranks work at once
    # the copies of the two collectives through the communicator are timed, not the 50 ms a rank
    # waits in them for the other's work
    assert 0 < staged0 < 0.04 and 0 < staged1 < 0.04, (staged0, staged1)


def test_a_turn_times_its_waits_for_the_gpu(tmp_path, monkeypatch):
    """A turn's waits for the GPU (each 20 ms here: before a collective's copies, where it gives up the
    GPU inside the collective, and at the turn's end) are timed as ``drain``, apart from the copies
    (``staging``: 2 x 5 ms and the wait after them, not the pause) and from the host's own 30 ms, which
    ``host_busy_s`` read inside the turn gives too; a collective outside a turn counts nowhere."""
    from harness import shared_gpu

    monkeypatch.setattr(shared_gpu, "_synchronize", lambda: time.sleep(0.02))
    monkeypatch.setenv(shared_gpu.TURNS_ENV, str(tmp_path / "turns.lock"))
    monkeypatch.setattr(shared_gpu.Turns, "fd", None)
    for name in ("held_s", "staged_s", "drained_s"):
        monkeypatch.setattr(shared_gpu.Turns, name, 0.0)
    shared_gpu.Turns.open()
    try:
        def collective():  # copies, the wait for the other ranks, copies
            time.sleep(0.005)
            with shared_gpu.Turns.paused():
                time.sleep(0.02)
            time.sleep(0.005)

        with shared_gpu.Turns.turn():
            busy0 = shared_gpu.host_busy_s()
            time.sleep(0.03)
            shared_gpu.Turns.staging(collective)()
            busy = shared_gpu.host_busy_s() - busy0  # read inside the turn: its host busy so far
        shared_gpu.Turns.staging(collective)()
        c = shared_gpu.turn_counters()
    finally:
        os.close(shared_gpu.Turns.fd)
    assert 0.058 < c["drain"] < 0.08, c
    assert 0.028 < c["staging"] < 0.045, c
    assert 0.028 < c["turn"] - c["staging"] - c["drain"] < 0.045, c
    assert 0.028 < busy < 0.045, busy
