"""Where an engine's start goes: the benchmarks' engine (bench_ttft.engine, Qwen3.6-35B-A3B shape,
dummy weights) built with its engine core and worker in this process, the main thread's Python stack
sampled every few seconds. Written for the compiled engine's 77-87 s warm-up run at 128k tokens
(benchmarks/results/2026-12-01-h200/ttft_pcp1_compiled/); one GPU is enough:

    python -m tests.gpu.probe_engine_start --out probe_start --tokens 131072 --compiled

Writes ``samples.txt`` (every stack) and ``summary.json`` (seconds per innermost frame of ours, vLLM's,
torch's, Triton's or fla's code, and per phase of vLLM's start) and prints the summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# vLLM's start phases by the runner function on the stack, first match wins (torch.compile itself
# runs inside the first profile run, and compiled graphs run under torch/_dynamo frames, so files do
# not tell the phase)
PHASES = (
    ("cuda graph capture", "capture_model"),
    ("profile run (torch.compile inside)", "profile_run"),
    ("warm-up run", "_dummy_run"),
    ("weights", "load_model"),
)
# a frame of these means a kernel is being built (Triton's compiler, Inductor's code cache)
BUILDING = ("/triton/compiler/", "/triton/backends/", "/torch/_inductor/codecache",
            "/torch/_inductor/async_compile")


def sample(stop: threading.Event, main_id: int, every: float, samples: list) -> None:
    t0 = time.time()
    while not stop.wait(every):
        frame = sys._current_frames().get(main_id)
        if frame is not None:
            samples.append((round(time.time() - t0, 1), traceback.extract_stack(frame)))


def innermost_library_frame(stack) -> str:
    """The innermost frame in a library that matters here (not the stdlib's waiting/threading)."""
    for fr in reversed(stack):
        f = fr.filename
        for lib in ("triton", "fla", "torch/_inductor", "torch/_dynamo", "vllm", "qwen36_pcp"):
            if f"/{lib}/" in f:
                return f"{lib}: {Path(f).name}:{fr.lineno} {fr.name}"
    return f"{Path(stack[-1].filename).name}:{stack[-1].lineno} {stack[-1].name}"


def phase_of(stack) -> str:
    names = {fr.name for fr in stack}
    phase = next((phase for phase, function in PHASES if function in names), "imports / setup")
    building = any(part in fr.filename for fr in stack for part in BUILDING)
    return f"{phase}, building kernels" if building else phase


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe_start")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--config", default="pcp1")
    parser.add_argument("--compiled", action="store_true")
    # in-process, the compiled 35b engine at 128k tokens had 893 Mamba blocks, under vLLM's default 1024
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between stack samples")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core (and at tp=1 the worker) here
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_ttft

    model = bench_ttft.checkpoint(str(out))
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=sample, args=(stop, threading.get_ident(), args.every, samples),
                               daemon=True)
    t0 = time.time()
    sampler.start()
    try:  # the samples are written even when the engine fails to start
        bench_ttft.engine(model, args.config, args.tokens, args.compiled, max_num_seqs=args.max_num_seqs)
        start_s = round(time.time() - t0, 1)
    except Exception as e:  # noqa: BLE001 - reported in the summary
        start_s = f"failed after {time.time() - t0:.0f} s: {str(e)[-300:]}"
    stop.set()
    per_frame, per_phase = collections.Counter(), collections.Counter()
    with open(out / "samples.txt", "w") as f:
        for t, stack in samples:
            f.write(f"=== t={t} s\n{''.join(traceback.format_list(stack[-25:]))}\n")
            phase = phase_of(stack)
            per_frame[(phase, innermost_library_frame(stack))] += args.every
            per_phase[phase] += args.every
    summary = {"config": args.config, "tokens": args.tokens, "compiled": args.compiled,
               "start_s": start_s, "seconds_per_phase": dict(per_phase.most_common()),
               "seconds_per_frame": [(p, fr, s) for (p, fr), s in per_frame.most_common(40)]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
