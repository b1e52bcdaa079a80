# SPDX-License-Identifier: Apache-2.0
"""Tensor calls the runner's own code makes in a spread decode step, by function (CPU, no GPU).

A spread decode step's extra over pcp=1's step is host work (``docs/performance.md``), and a large
part of it is one tensor call after another: each costs the host microseconds on a GPU whatever its
size. This counts them, through PyTorch's dispatcher (``TorchDispatchMode``: every aten call, views
included), in the CPU stand-in of the runner that ``tests/test_runner.py`` checks the spread step
with (``harness/runner_stand_in.py``: vLLM's buffers, its dispatcher, two KV-cache groups, two attention
layers, real gloo ranks).
The stand-in's own parts (vLLM's input preparation, dispatch, slot mapping, metadata build, the
model, whose layers keep their K/V in the stage as they write it) are left out, so what is counted
is ours: the plan's device indices, the owned batch's heads, the K/V sent and written, the output
gather.

    python benchmarks/spread_host_ops.py            # pcp = 2, 4 at B = 1, 8; about a minute
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: harness/

# aten calls that only make a view (no allocation, copy or kernel)
VIEWS = {"view", "slice", "select", "detach", "permute", "lift_fresh", "alias", "_reshape_alias", "unsqueeze",
         "expand", "as_strided", "t", "transpose", "split_with_sizes", "split", "narrow", "squeeze", "unbind"}
STAND_IN = ("_prepare_inputs", "_determine_batch_execution_and_padding", "_get_slot_mappings",
            "_build_attention_metadata")


def _counter():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        """aten calls by (the package's function that made them, call name), while ``on``."""

        def __init__(self):
            super().__init__()
            self.calls, self.on = collections.Counter(), True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.on:
                frame, where = sys._getframe(1), "?"
                while frame is not None:
                    if "/qwen36_pcp/" in frame.f_code.co_filename:
                        where = f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"
                        break
                    frame = frame.f_back
                self.calls[(where, func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    del torch
    return Count()


def count_step(rank: int, group, batch: int) -> dict:
    """The calls of this rank's spread decode step of ``batch`` requests (the third of three, so that
    anything built once is built), by function and call name."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from harness import runner_stand_in as stand_in

    runner = stand_in.spread_runner(group, rank, [], {})
    stand_in.cuda_graphs(runner, CUDAGraphMode.FULL_AND_PIECEWISE)
    counter = _counter()

    def uncounted(fn):
        def call(*args, **kwargs):
            was, counter.on = counter.on, False
            try:
                return fn(*args, **kwargs)
            finally:
                counter.on = was
        return call

    for name in STAND_IN:
        setattr(GPUModelRunner, name, uncounted(getattr(GPUModelRunner, name)))
    runner.model = uncounted(runner.model)
    # the stand-in's K/V write (vLLM's is one kernel per layer): not counted
    for _, layers in runner.spread.attention_groups:
        for layer in layers:
            layer.impl.cache_writer = uncounted(layer.impl.cache_writer)
    for step in range(3):
        counter.calls.clear()
        spread_decode_step(runner, batch, step, around=counter)
    return {f"{where} {name}": n for (where, name), n in counter.calls.items()}


def spread_decode_step(runner, batch: int, step: int, around=None) -> None:
    """Step ``step`` of ``batch`` requests decoding through the stand-in runner, as vLLM's
    ``execute_model`` calls the runner's parts (inputs, dispatch, slots, metadata, the model), those
    calls inside the context manager ``around``; the requests' state set before it."""
    from harness import runner_stand_in as stand_in

    req_ids, num_new = [f"r{i}" for i in range(batch)], np.ones(batch, dtype=np.int32)
    computed = np.array([100 + 3 * i + step for i in range(batch)])
    runner.input_batch = SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=computed,
                                         num_prompt_tokens=np.full(batch, 50), block_table=stand_in.BlockTables())
    runner.requests = {r: SimpleNamespace(num_tokens=200, block_ids=([], [])) for r in req_ids}
    runner.cache_config = SimpleNamespace(mamba_cache_mode="none")
    with around if around is not None else contextlib.nullcontext():
        stand_in.execute_spread_runner(runner, num_new)
    runner.pcp_step = None


def summarize(calls: dict) -> dict:
    """Totals and per-function counts, views apart."""
    by_function: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, n in calls.items():
        where, name = key.rsplit(" ", 1)
        by_function[where][name in VIEWS] += n
    total = sum(calls.values())
    views = sum(n for key, n in calls.items() if key.rsplit(" ", 1)[1] in VIEWS)
    return {"calls": total, "views": views, "by_function": dict(by_function)}


def main() -> None:
    from harness.dist import run_distributed

    print("tensor calls of a spread decode step, rank 0, the runner's own code (views: no allocation, "
          "copy or kernel)")
    for world, batch in ((2, 1), (2, 8), (4, 1), (4, 8)):
        s = summarize(run_distributed(count_step, world, batch)[0])
        print(f"pcp={world} B={batch}: {s['calls']} calls, {s['calls'] - s['views']} beside {s['views']} views")
        for where, (work, views) in sorted(s["by_function"].items(), key=lambda kv: -sum(kv[1])):
            print(f"    {where:45s} {work:4d} + {views:3d} views")


if __name__ == "__main__":
    main()
