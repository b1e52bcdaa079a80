# SPDX-License-Identifier: Apache-2.0
"""Where one long prefill's GPU time goes, rank by rank: why TTFT at pcp=N is not N times shorter.

Same engines as bench_ttft.py (Qwen3.6-35B-A3B shape, dummy weights, eager or ``--compiled``, the
whole prompt in one prefill step). Each config: a warm-up prefill, then one under vLLM's torch
profiler. From every rank's trace: GPU kernel time by kind (attention, GDN, MoE, GEMM, communication,
other), the time the GPU was busy and the span from its first to its last kernel (span - busy: the
GPU waiting for the host). Communication time on a PCP rank includes waiting for the slower rank.
Prints a table, writes JSON and a PNG:

    python benchmarks/profile_prefill.py --out /tmp/profile_prefill --tokens 131072 --configs pcp1 pcp2_state_passing
    python benchmarks/profile_prefill.py --out /tmp/profile_prefill --report-only   # from the traces already there
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/, tests/
from benchmarks import bench_ttft  # noqa: E402
from benchmarks.plot import save_figure  # noqa: E402

# first match wins: FA3's kernels are cutlass templates, so attention comes before GEMM
KINDS = (
    # host copies: a shared-GPU engine's collectives (on GPUs of their own, a step's few input copies)
    ("communication", r"nccl|all_?gather|reduce_?scatter|all_?reduce|cross_device|memcpy (dtoh|htod)"),
    ("attention", r"flash|fmha|attn|attention"),
    ("gdn", r"chunk|solve_tril|recompute_w_u|kkt|delta_rule|causal_conv1d|fused_recurrent|l2norm|"
            r"merge_16x16|gdn|post_conv|cumsum"),
    ("moe", r"moe|topk|expert|align_block|count_and_sort"),
    ("gemm", r"gemm|nvjet|xmma|cublas|cutlass|matmul"),
)
KIND_NAMES = [kind for kind, _ in KINDS] + ["other"]
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize_trace(events: list[dict], top: int = 15) -> dict:
    """Per-kind kernel milliseconds, busy and span milliseconds, the top kernels of one rank, and its
    GPU-busy milliseconds of compute (every kind but communication) between one copy to the host and
    the next (``segments_ms``: on a shared GPU every collective starts with one on every rank)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_EVENTS),
                 key=lambda e: e["ts"])
    if not gpu:
        return {}
    kinds, by_name, segments = dict.fromkeys(KIND_NAMES, 0.0), {}, [[]]
    for e in gpu:
        kind = kind_of(e["name"])
        kinds[kind] += e["dur"] / 1e3
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"] / 1e3
        if "memcpy dtoh" in e["name"].lower():
            segments.append([])
        elif kind != "communication":
            segments[-1].append((e["ts"], e["ts"] + e["dur"]))
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    names = sorted(by_name, key=by_name.get, reverse=True)[:top]
    return {"kinds_ms": kinds, "busy_ms": _busy_us(intervals) / 1e3, "span_ms": span / 1e3,
            "kernels": len(gpu), "top": [[n[:120], kind_of(n), by_name[n]] for n in names],
            "segments_ms": [_busy_us(s) / 1e3 for s in segments], "by_kernel_ms": by_name}


def beyond_share(rank: dict, pcp1: dict, n: int, top: int = 6) -> tuple[float, list]:
    """Kernel milliseconds a pcp=n rank spends beyond 1/n of pcp=1's, kernel by kernel (host copies left
    out): the split step's own work (copies, concatenations, index work). GEMMs count as one, since
    cuBLAS picks its kernels by shape. Returns the total and the largest ``top``."""
    extra = {}
    for times, scale in ((rank["by_kernel_ms"], 1.0), (pcp1["by_kernel_ms"], -1.0 / n)):
        for k, ms in times.items():
            kind = kind_of(k)
            if kind != "communication":
                key = "GEMMs (cuBLAS)" if kind == "gemm" else k
                extra[key] = extra.get(key, 0.0) + scale * ms
    largest = sorted(extra, key=extra.get, reverse=True)[:top]
    return sum(extra.values()), [[k[:120], kind_of(k), extra[k]] for k in largest]


def critical_path_ms(ranks: list[dict]) -> tuple[float, bool]:
    """GPU compute time of one step on N GPUs of their own from each rank's profile, and whether the
    ranks' collectives paired up. Ranks meet at every collective, so each stretch between two lasts as
    long as its slowest rank. Where the ranks' copies to the host do not pair up (another count per
    rank), only the slowest rank's compute time: a lower bound, reported as unpaired."""
    segments = [r["segments_ms"] for r in ranks]
    if len({len(s) for s in segments}) == 1:
        return sum(max(column) for column in zip(*segments)), True
    return max(sum(s) for s in segments), False


def traces(trace_dir: str):
    """(the trace file's rank label, its events) for every torch profiler trace in ``trace_dir``."""
    for path in sorted(glob.glob(os.path.join(trace_dir, "*.pt.trace.json*"))):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        label = re.search(r"rank\d+", os.path.basename(path))
        yield (label.group(0) if label else os.path.basename(path)), events


def summarize_dir(trace_dir: str) -> dict:
    """{trace file's rank label: summary} for every trace with GPU events in ``trace_dir``."""
    return {label: summary for label, events in traces(trace_dir) if (summary := summarize_trace(events))}


def child(model: str, config: str, tokens: int, trace_dir: str, path: str, compiled: bool,
          shared_gpu: bool) -> None:
    from vllm import SamplingParams

    kw = bench_ttft.shared_gpu_engine_args(config) if shared_gpu else {}
    llm = bench_ttft.engine(model, config, tokens, compiled, **kw, **bench_ttft.profiler_args(trace_dir))
    sp, p = SamplingParams(max_tokens=1, temperature=0.0), bench_ttft.prompt(tokens)
    llm.generate([p], sp, use_tqdm=False)  # warm-up (JIT, autotune)
    llm.start_profile()
    t0 = time.perf_counter()
    llm.generate([p], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.stop_profile()
    with open(path, "w") as f:
        json.dump({"tokens": tokens, "profiled_wall_s": wall, "mode": bench_ttft.mode(compiled),
                   "kkt_configs": bench_ttft.kkt_configs(), "shared_gpu": shared_gpu}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/profile_prefill")
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--configs", nargs="+", default=["pcp1", "pcp2_state_passing", "tp2"],
                        choices=list(bench_ttft.CONFIGS))
    parser.add_argument("--kkt-configs", choices=list(bench_ttft.KKT_ENV), default="race_free")
    parser.add_argument("--compiled", action="store_true", help="torch.compile + CUDA graphs (vLLM's default)")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on GPU 0, taking turns between collectives (each rank's kernels "
                             "run alone: their times are those of a GPU per rank; the wall time is not)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the model's first layers only (a multiple of 4), e.g. to fit every rank's "
                             "whole experts on one GPU with --shared-gpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # config, trace dir, result path
    args = parser.parse_args()
    if args.child:
        config, trace_dir, path = args.child
        child(args.model, config, args.tokens, trace_dir, path, args.compiled, args.shared_gpu)
        return
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        model = args.model or bench_ttft.checkpoint(args.out, args.layers)
        for config in args.configs:
            trace_dir = os.path.join(args.out, f"trace_{config}")
            os.makedirs(trace_dir, exist_ok=True)
            argv = [__file__, "--model", model, "--tokens", str(args.tokens), "--child", config, trace_dir,
                    os.path.join(args.out, f"profile_{config}.json")] + ["--compiled"] * args.compiled
            argv += ["--shared-gpu"] * args.shared_gpu
            turns_lock = os.path.join(os.path.abspath(args.out), "shared_gpu_turns.lock")
            bench_ttft.run_child(argv, os.path.join(args.out, f"profile_{config}.log"), args.kkt_configs,
                                 turns_lock=turns_lock if args.shared_gpu else None)
    report(args.out, args.configs)


def report(out: str, configs: list[str]) -> None:
    rows = {}
    for config in configs:
        result = os.path.join(out, f"profile_{config}.json")
        meta = json.load(open(result)) if os.path.exists(result) else {}
        ranks = summarize_dir(os.path.join(out, f"trace_{config}"))
        critical, paired = critical_path_ms(list(ranks.values())) if ranks else (None, False)
        for rank, summary in ranks.items():
            rows[f"{config}/{rank}"] = dict(summary, profiled_wall_s=meta.get("profiled_wall_s"),
                                            mode=meta.get("mode", "eager"), critical_ms=critical,
                                            critical_paired=paired, shared_gpu=meta.get("shared_gpu", False))
    extra_lines = []
    if "pcp1/rank0" in rows:
        for name, r in rows.items():
            config = name.split("/")[0]
            n = sum(k.startswith(config + "/") for k in rows)
            if config.startswith("pcp") and n > 1:
                r["beyond_pcp1_share_ms"], r["beyond_pcp1_share_top"] = beyond_share(r, rows["pcp1/rank0"], n)
                extra_lines.append(f"{name:>28} | {r['beyond_pcp1_share_ms']:+7.2f} | " + ", ".join(
                    f"{k[:40]} {ms:+.2f}" for k, _, ms in r["beyond_pcp1_share_top"][:3]))
    for r in rows.values():
        r.pop("by_kernel_ms")
    modes = "/".join(sorted({r["mode"] for r in rows.values()})) or "eager"
    print(f"GPU time of one profiled prefill (ms), Qwen3.6-35B-A3B shape, dummy weights, {modes}")
    print("critical: the ranks' compute time on GPUs of their own (the slowest rank between collectives;"
          " * where the ranks' collectives did not pair up: the slowest rank's total, a lower bound)")
    print(f"{'config/rank':>28} | " + " | ".join(f"{k[:8]:>8}" for k in KIND_NAMES)
          + " |     busy |     span | critical | wall (s)")
    for name, r in rows.items():
        wall = f"{r['profiled_wall_s']:.3f}" if r["profiled_wall_s"] else "?"
        print(f"{name:>28} | " + " | ".join(f"{r['kinds_ms'][k]:8.1f}" for k in KIND_NAMES)
              + f" | {r['busy_ms']:8.1f} | {r['span_ms']:8.1f} | {r['critical_ms']:7.1f}"
              + f"{' ' if r['critical_paired'] else '*'} | {wall}")
    if extra_lines:
        print("\nkernel time beyond 1/N of pcp=1's (ms; host copies left out): total | largest kernels")
        print("\n".join(extra_lines))
    with open(os.path.join(out, "profile_prefill.json"), "w") as f:
        json.dump(rows, f, indent=1)

    def draw(ax):
        names = list(rows)
        bottom = [0.0] * len(names)
        for k in KIND_NAMES:
            ms = [rows[n]["kinds_ms"][k] for n in names]
            ax.barh(names, ms, left=bottom, label=k)
            bottom = [b + m for b, m in zip(bottom, ms)]
        ax.set_xlabel("GPU kernel time (ms)")

    if rows:
        save_figure(os.path.join(out, "profile_prefill.png"), draw)


if __name__ == "__main__":
    main()
