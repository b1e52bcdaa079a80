# SPDX-License-Identifier: Apache-2.0
"""The host-phase timers of the decode benchmark: on the runner's real spread step (the CPU stand-in of
``tests/test_runner.py`` on 2 gloo ranks) every phase is timed once per step under the label of the
class that defines it, a phase holds the phases it calls, and a garbage collection is timed by its
generation."""

from __future__ import annotations

from harness.dist import run_distributed

STEPS = 3


def _timed_spread_steps(rank, group, steps_log):
    import gc
    import os
    from collections import Counter
    from pathlib import Path
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from benchmarks import host_phases
    from benchmarks.spread_host_ops import spread_decode_step
    from harness import runner_stand_in as stand_in
    from harness.shared_gpu import STEPS_ENV, record_step_kinds

    runner = stand_in.spread_runner(group, rank, [], {})
    stand_in.cuda_graphs(runner, CUDAGraphMode.FULL_AND_PIECEWISE)
    # the bench's workers record their step kinds from the start, before the phases are wrapped
    os.environ[STEPS_ENV] = steps_log
    record_step_kinds(SimpleNamespace(model_runner=runner, rank=rank))
    host_phases.start_host_phases()  # after the stand-in's parts took the place of vLLM's: they are timed
    for step in range(STEPS):
        spread_decode_step(runner, 8, step)
    gc.collect(1)  # a collection during the timing: timed by its generation
    lines = Path(f"{steps_log}.{rank}").read_text().splitlines()
    return host_phases.host_phases(), dict(Counter(line.split()[0] for line in lines))


def test_each_phase_of_a_spread_step_is_timed_once_per_step_and_holds_the_phases_it_calls(tmp_path):
    for phases, kinds in run_distributed(_timed_spread_steps, 2, str(tmp_path / "steps")):
        assert kinds == {"owned_full": STEPS}, kinds
        once = ("PCPModelRunner._prepare_inputs", "GPUModelRunner._prepare_inputs", "StepPlanner.plan",
                "OwnedBatch.write_heads", "GPUModelRunner._determine_batch_execution_and_padding",
                "GPUModelRunner._build_attention_metadata", "PCPModelRunner._model_forward",
                "SpreadDecode.forward", "GPUModelRunner._model_forward", "PCPContext.__init__",
                "runner_part.defer_staged_kv", "PCPContext.gather_output")
        assert {label: phases[label][1] for label in once} == dict.fromkeys(once, STEPS), phases
        assert phases["gc gen1"][1] >= 1, phases
        ms = {label: v[0] for label, v in phases.items()}
        assert all(v > 0 for v in ms.values()), ms
        # inclusive: the plugin's input preparation holds vLLM's, the plan and the heads; its owned
        # forward holds the model call, the K/V sent from the stage and the gather
        assert ms["PCPModelRunner._prepare_inputs"] >= (
            ms["GPUModelRunner._prepare_inputs"] + ms["StepPlanner.plan"] + ms["OwnedBatch.write_heads"])
        assert ms["SpreadDecode.forward"] >= (
            ms["GPUModelRunner._model_forward"] + ms["runner_part.defer_staged_kv"] + ms["PCPContext.gather_output"])
        assert ms["PCPModelRunner._model_forward"] >= ms["SpreadDecode.forward"]


def test_the_tensor_call_counter_runs_a_spread_step():
    """``spread_host_ops.count_step`` drives the runner's real spread step on 2 gloo ranks and counts
    the runner's own tensor calls."""
    from benchmarks.spread_host_ops import count_step, summarize

    for calls in run_distributed(count_step, 2, 2):
        s = summarize(calls)
        assert s["calls"] > s["views"] >= 0 and s["by_function"], s
