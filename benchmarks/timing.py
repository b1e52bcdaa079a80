# SPDX-License-Identifier: Apache-2.0
"""GPU time of a call, as the benchmarks take it."""

from __future__ import annotations

import statistics


def cuda_median_ms(fn, reps: int, before_each=None) -> float:
    """Median over ``reps`` of ``fn``'s GPU time between two CUDA events, after one warm-up call;
    ``before_each`` runs before every timed call (a barrier, so that ranks start together)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
