# SPDX-License-Identifier: Apache-2.0
"""Where the host's time of a prefill goes: vLLM's whole request path in one process under cProfile.

    python benchmarks/profile_host.py --out DIR [--tokens 32768 131072] [--layers 4] [--config pcp2]

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and at pcp=1 the worker
too (the uniprocess executor), so one profile covers input processing, scheduling, the runner's input
preparation, the model's Python, sampling and output processing. ``--config pcp2``: every rank on
GPU 0 in worker processes of their own (``bench_ttft.shared_gpu_engine_args``), so the profile holds
the front end and the engine core (the first token's detokenization among them). The model is the Qwen3.6-35B-A3B
shape cut to its first ``--layers`` layers (dummy weights, eager), which keeps GPU time small beside
the host's. Per length: the wall time of ``generate`` (one token) and the functions with the most own
and cumulative time; what grows with the prompt is the host's time per prompt token.

``start_worker_profile`` / ``stop_worker_profile`` (``collective_rpc`` targets) profile a running
engine's workers the same way, each rank into a file of its own (``bench_decode_spread --profile``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/

_worker_profiler: cProfile.Profile | None = None


def start_worker_profile(worker=None) -> None:
    """In a worker: cProfile from now on (``collective_rpc`` target)."""
    global _worker_profiler
    _worker_profiler = cProfile.Profile()
    _worker_profiler.enable()


def stop_worker_profile(worker, prefix: str, steps: int, top: int = 40) -> dict:
    """In a worker: stop the profile, write ``<prefix>.rank<r>.txt`` (functions by cumulative and own
    time) and return {function: cumulative ms per step} of the ``top`` with the most."""
    global _worker_profiler
    profiler, _worker_profiler = _worker_profiler, None
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    rank = getattr(worker, "rank", 0)
    Path(f"{prefix}.rank{rank}.txt").write_text(text.getvalue())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]
    return {f"{Path(f).name}:{line}({name})": 1e3 * cum / steps for (f, line, name), (_, _, _, cum, _) in rows}


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/profile_host")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--config", default="pcp1", help="a bench_ttft config (pcp > 1: on GPU 0)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from benchmarks.bench_ttft import checkpoint, engine, median_generate_s, prompt, shared_gpu_engine_args

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shared = shared_gpu_engine_args(args.config) if args.config != "pcp1" else {"gpu_memory_utilization": 0.8}
    llm = engine(checkpoint(str(out), args.layers), args.config, max(args.tokens), **shared)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    summary = {}
    for tokens in args.tokens:
        p = prompt(tokens)
        wall = median_generate_s(llm, p, sp, args.reps)
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate([p], sp, use_tqdm=False)
        profiler.disable()
        profiler.dump_stats(out / f"host_{tokens}.prof")
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        (out / f"host_{tokens}.txt").write_text(text.getvalue())
        detokenize = sum(v[2] for (_, _, name), v in stats.stats.items() if "DecodeStream" in name)
        summary[tokens] = {"wall_s": wall, "profiled_wall_s": stats.total_tt,
                           "decode_stream_s": detokenize}
        print(f"{tokens} tokens: generate {summary[tokens]['wall_s']:.3f} s (median of {args.reps}); "
              f"under the profiler {stats.total_tt:.3f} s, of which tokenizers' DecodeStream {detokenize:.4f} s")
        print(text.getvalue()[:6000])
    (out / "profile_host.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
