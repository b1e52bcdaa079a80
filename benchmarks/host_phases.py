# SPDX-License-Identifier: Apache-2.0
"""Where a step's host time goes, per rank and phase: the runner's own steps (vLLM's and the plugin's)
timed on the host, with no profiler in the way.

cProfile times every Python call, so it inflates a step made of many small calls more than one made
of few, and the spread decode step against pcp=1's is exactly that comparison. Here only the
functions in ``PHASES`` are wrapped (a few microseconds per call; a spread decode step makes about
ten more of these calls than pcp=1's, and the turn times the bench reports hold them). In the
shared GPU's turns a phase's time is the host busy (``harness.shared_gpu.host_busy_s``: the waits for
the GPU, the collectives' copies and the waits for the other ranks left out); without turns, wall
time. Phases nest (``execute_model`` holds ``_prepare_inputs``, which holds ``StepPlanner.plan``): each is
inclusive, and a label names the class that defines the function, so vLLM's ``_prepare_inputs`` and
the plugin's override around it are two rows.

Python's garbage collections are timed too, by generation (``gc.callbacks``; ``gc gen<g>``): vLLM
freezes the heap in the engine core but not in its workers, so a worker's collections traverse what
its step allocated and, for the oldest generation, the whole model's objects.

``start_host_phases`` / ``host_phases`` are ``collective_rpc`` targets (``bench_decode_spread``).
"""

from __future__ import annotations

import functools
import gc
import importlib
import time

# (module, class or None for a module function, names)
PHASES = (
    ("vllm.v1.worker.gpu_worker", "Worker", ("execute_model", "sample_tokens")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
     ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs", "_determine_batch_execution_and_padding",
      "_build_attention_metadata", "_preprocess", "_model_forward", "_sample", "_bookkeeping_sync")),
    ("qwen36_pcp.runner_hooks.runner", "PCPModelRunner", ("execute_model", "_prepare_inputs", "_model_forward")),
    ("qwen36_pcp.runner_hooks.planner", "StepPlanner", ("plan",)),
    ("qwen36_pcp.spread.runner_part", "SpreadDecode", ("forward", "share_filled_state_blocks")),
    ("qwen36_pcp.spread.runner_part", None, ("defer_staged_kv",)),
    ("qwen36_pcp.spread.owned_batch", "OwnedBatch", ("write_heads",)),
    ("qwen36_pcp.layers.context", "PCPContext", ("__init__", "gather_output")),
)

_totals: dict[str, list[float]] = {}  # label -> [seconds, calls]
_installed = False


def _clock():
    try:
        from harness.shared_gpu import host_busy_s
    except ImportError:  # outside the repository's harness
        return time.perf_counter
    return host_busy_s


def _add(label: str, seconds: float) -> None:
    total = _totals.setdefault(label, [0.0, 0])
    total[0] += seconds
    total[1] += 1


def timed(label: str, fn, clock):
    """``fn`` with its time per call added to ``_totals[label]``."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(label, clock() - t0)
    return call


_gc_started = [0.0]


def _time_collection(phase: str, info: dict) -> None:
    """A ``gc.callbacks`` callback: each collection's wall time under ``gc gen<generation>``."""
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    _add(f"gc gen{info['generation']}", time.perf_counter() - _gc_started[0])


def install(phases=PHASES, model=None) -> None:
    """Wrap the phases (those a module defines; once per process) and ``model``'s class's
    ``compute_logits`` (the logits of the rows vLLM samples); time the garbage collections."""
    global _installed
    if _installed:
        return
    _installed = True
    gc.callbacks.append(_time_collection)
    clock = _clock()
    for module_name, cls_name, names in phases:
        module = importlib.import_module(module_name)
        owner = getattr(module, cls_name) if cls_name else module
        for name in names:
            if name in vars(owner):
                setattr(owner, name, timed(f"{cls_name or module_name.rsplit('.', 1)[-1]}.{name}",
                                           vars(owner)[name], clock))
    if model is not None and "compute_logits" in dir(type(model)):
        setattr(type(model), "compute_logits",
                timed(f"{type(model).__name__}.compute_logits", type(model).compute_logits, clock))


def start_host_phases(worker=None) -> None:
    """In a worker: the phases wrapped, their totals from zero (``collective_rpc`` target)."""
    runner = getattr(worker, "model_runner", None)
    install(model=runner.get_model() if runner is not None else None)
    _totals.clear()


def host_phases(worker=None) -> dict[str, list[float]]:
    """In a worker: {label: [ms, calls]} since ``start_host_phases`` (``collective_rpc`` target)."""
    return {label: [1e3 * s, n] for label, (s, n) in _totals.items()}
