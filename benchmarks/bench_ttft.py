# SPDX-License-Identifier: Apache-2.0
"""Time to first token vs prompt length, and decode ITL: pcp=1, tp=2, pcp=2 (defaults: GDN relay,
whole experts), pcp=2 with GDN state passing, with vLLM's expert sharding (``moe_experts="sharded"``),
and with GDN island.

Qwen3.6-35B-A3B shape with dummy weights (config from the checkpoint maker, no download), eager
(``--compiled``: vLLM's default torch.compile + CUDA graphs), the whole prompt in one prefill step.
Needs 2 GPUs (pcp1 alone: 1); prints a table (TTFT, decode ITL, peak memory per rank) and writes
JSON + PNG. The current defaults against pcp=1 and tp=2 on a 2-GPU machine, in one call:

    python benchmarks/bench_ttft.py --out /tmp/bench_ttft --tokens 32768 131072 --configs pcp1 tp2 pcp2

Every config runs the same GDN kernel configs: ``--kkt-configs race_free`` (default) keeps vLLM's
``chunk_scaled_dot_kkt_fwd`` to its race-free autotune configs and two more GDN kernels to one
output's configs in every engine, as PCP does (``qwen36_pcp.deterministic_gdn.pin_gdn_configs``);
``all`` lets the autotuners pick from all of them, as vLLM does (at pcp=2 too). Run both on pcp1 to
see what the pins cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/, tests/
from benchmarks.plot import save_figure  # noqa: E402

CONFIGS = {
    "pcp1": dict(tensor_parallel_size=1, prefill_context_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2, prefill_context_parallel_size=1),
    "pcp2": dict(prefill_context_parallel_size=2),  # the defaults: GDN relay, whole experts
    "pcp2_state_passing": dict(prefill_context_parallel_size=2,
                               additional_config={"qwen36_pcp": {"gdn_mode": "state_passing"}}),
    "pcp2_island": dict(prefill_context_parallel_size=2,
                        additional_config={"qwen36_pcp": {"gdn_mode": "island"}}),
    "pcp2_sharded_experts": dict(prefill_context_parallel_size=2,
                                 additional_config={"qwen36_pcp": {"moe_experts": "sharded"}}),
    # the earlier defaults (measured on 2 x H200 on 2026-11-29 as "pcp2_state_passing")
    "pcp2_state_passing_sharded": dict(prefill_context_parallel_size=2, additional_config={
        "qwen36_pcp": {"gdn_mode": "state_passing", "moe_experts": "sharded"}}),
    "pcp4": dict(prefill_context_parallel_size=4),
}
ITL_PROMPT, ITL_TOKENS = 1024, 129  # decode: (time for 129 tokens - time for 1) / 128


KKT_ENV = {"race_free": "1", "all": "0"}  # -> QWEN36_PCP_DETERMINISTIC_GDN in every engine


def mode(compiled: bool) -> str:
    return "compiled" if compiled else "eager"


def kkt_configs() -> str:
    """In an engine's process: which kkt configs ``run_child`` chose for it."""
    value = os.environ.get("QWEN36_PCP_DETERMINISTIC_GDN")
    return next((name for name, v in KKT_ENV.items() if v == value), "?")


def engine(model: str, config: str, longest: int, compiled: bool = False, **kw):
    """The benchmarks' engine: one config, every prompt up to ``longest`` in one prefill step."""
    from vllm import LLM

    args = dict(model=model, load_format="dummy", hf_overrides={"architectures": ["Qwen3_6ForCausalLM"]},
                gdn_prefill_backend="triton", enforce_eager=not compiled, max_model_len=longest + 16,
                max_num_batched_tokens=longest, gpu_memory_utilization=0.85, seed=0,
                enable_prefix_caching=False)  # every rep a full prefill
    return LLM(**{**args, **CONFIGS[config], **kw})  # kw may replace a default (the shared GPU's memory)


def profiler_args(trace_dir: str | None) -> dict:
    """Engine arguments for vLLM's torch profiler writing each worker's trace into ``trace_dir`` (None:
    no profiler)."""
    if not trace_dir:
        return {}
    return {"profiler_config": dict(profiler="torch", torch_profiler_dir=os.path.abspath(trace_dir),
                                    torch_profiler_with_stack=False, torch_profiler_dump_cuda_time_total=False)}


def shared_gpu_engine_args(config: str) -> dict:
    """Every rank of ``config`` on GPU 0 (harness/shared_gpu.py), taking turns between collectives
    (``run_child(turns_lock=...)`` names the lock): each rank's kernels run alone, so per-rank kernel
    times are those of one GPU per rank. The ranks share the GPU's memory."""
    cfg = CONFIGS[config]
    return shared_gpu_args(cfg.get("tensor_parallel_size", 1) * cfg.get("prefill_context_parallel_size", 1))


def shared_gpu_args(ranks: int) -> dict:
    """An engine of ``ranks`` ranks on GPU 0 (``shared_gpu_engine_args``)."""
    return dict(worker_cls="harness.shared_gpu.SharedGPUWorker", distributed_executor_backend="mp",
                gpu_memory_utilization=0.9 / ranks, kv_cache_memory_bytes=8 << 30)


def prompt(n: int):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[(i * 7919) % 200000 + 10 for i in range(n)])


def checkpoint(out: str, layers: int | None = None, fp8: bool = False) -> str:
    """Qwen3.6-35B-A3B's config and tokenizer (no weights: the engines load dummy ones); ``layers``:
    its first layers only (whole periods of 3 GDN + 1 attention), so that every rank of a shared-GPU
    engine holds its weights; ``fp8``: the block-wise FP8 layout of the published FP8 checkpoint (its
    ``quantization_config``: dummy FP8 weights, half the bytes of bf16's)."""
    from qwen36_pcp.tools.make_checkpoint import make_checkpoint

    name = "qwen3.6-35b-a3b" + (f"-{layers}-layers" if layers else "") + ("-fp8" if fp8 else "")
    path = make_checkpoint(os.path.join(out, name), preset="qwen3.6-35b-a3b", fp8=fp8)
    if layers:
        config_path = path / "config.json"
        config = json.loads(config_path.read_text())
        text = config["text_config"]
        assert layers % text["full_attention_interval"] == 0, "whole periods of the layer pattern"
        text.update(num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
        config_path.write_text(json.dumps(config, indent=2))
    return str(path)


def run_child(argv: list[str], log_path: str, kkt_configs: str, in_process: bool = False,
              turns_lock: str | None = None, env: dict | None = None) -> None:
    """One engine in its own process (clean GPU memory between configs), with the chosen kkt configs;
    a failure is reported and the next config runs. ``in_process``: the engine core in that process;
    ``turns_lock``: the lock file by which a shared-GPU engine's ranks take turns (``shared_gpu_engine_args``);
    ``env``: more environment variables."""
    # VLLM_ALLOW_INSECURE_SERIALIZATION: collective_rpc with a function (peak_memory_per_rank)
    env = dict(os.environ, QWEN36_PCP_DETERMINISTIC_GDN=KKT_ENV[kkt_configs],
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env or {}))
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if turns_lock:
        env["QWEN36_PCP_SHARED_TURNS"] = turns_lock
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        print(f"exit {rc}, see {log_path}")


def child(model: str, config: str, tokens: list[int], reps: int, path: str, compiled: bool,
          budgets: list[int] = ()) -> None:
    """Writes {tokens: median seconds} to path after each length (a cut-off run keeps what it measured);
    with ``budgets``, also {"tokens@budget": ...} for the prompt cut into chunks of that many tokens."""
    from vllm import SamplingParams

    llm = engine(model, config, max(tokens), compiled)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    out = {"kkt_configs": kkt_configs(), "mode": mode(compiled)}
    # the scheduler reads its token budget every step (``budgets``: the engine core in this process)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler if budgets else None
    one_step = scheduler.max_num_scheduled_tokens if budgets else None
    for budget in [0, *budgets]:
        if budget:
            scheduler.max_num_scheduled_tokens = budget
        for n in tokens:
            out[f"{n}@{budget}" if budget else n] = median_generate_s(llm, prompt(n), sp, reps)
            with open(path, "w") as f:
                json.dump(out, f)
    if budgets:
        scheduler.max_num_scheduled_tokens = one_step
    out["itl_ms"] = 1e3 * decode_itl(llm, reps)
    out["peak_gib_per_rank"] = peak_memory_per_rank(llm)
    with open(path, "w") as f:
        json.dump(out, f)


def median_generate_s(llm, p, sp, reps: int) -> float:
    """Median seconds of ``llm.generate([p], sp)`` over ``reps``, after one warm-up (JIT, autotune) at
    this length."""
    llm.generate([p], sp, use_tqdm=False)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm.generate([p], sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_gib(worker) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def peak_memory_per_rank(llm) -> list[float] | str:
    """Each worker's peak of PyTorch-allocated GPU memory (weights, KV cache, activations), in GiB."""
    try:
        return [round(g, 2) for g in llm.collective_rpc(_peak_gib)]
    except Exception as e:  # noqa: BLE001 - a missing figure must not lose the timings
        return f"{type(e).__name__}: {e}"


def decode_itl(llm, reps: int) -> float:
    """Seconds per decode step of one request after a 1024-token prompt (split at pcp > 1 by the
    default min_split_tokens), median of ``reps``."""
    from vllm import SamplingParams

    p = prompt(ITL_PROMPT)

    def run(n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([p], sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(ITL_TOKENS)  # warm-up
    return statistics.median((run(ITL_TOKENS) - run(1)) / (ITL_TOKENS - 1) for _ in range(reps))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/bench_ttft")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=[c for c in CONFIGS if not c.startswith("pcp4")])  # up to 2 GPUs
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kkt-configs", choices=list(KKT_ENV), default="race_free")
    parser.add_argument("--compiled", action="store_true", help="torch.compile + CUDA graphs (vLLM's default)")
    parser.add_argument("--budgets", type=int, nargs="*", default=[],
                        help="also time each prompt cut into chunks of these many tokens (vLLM's "
                             "max_num_batched_tokens: 8192 for vllm serve, 16384 for LLM on an H200), "
                             "in the same engine, its engine core then in the benchmark's process")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None)
    parser.add_argument("--report-only", action="store_true",
                        help="no engines: table and plot from the ttft_<config>.json already in --out")
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child[0], args.tokens, args.reps, args.child[1], args.compiled, args.budgets)
        return
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        measure(args)
    report(args.out, args.configs, args.tokens)


def measure(args) -> None:
    """One engine per config, each in its own process."""
    model = args.model or checkpoint(args.out)
    for config in args.configs:
        path = os.path.join(args.out, f"ttft_{config}.json")
        argv = [__file__, "--model", model, "--tokens", *map(str, args.tokens), "--reps", str(args.reps),
                "--child", config, path] + ["--compiled"] * args.compiled
        if args.budgets:
            argv += ["--budgets", *map(str, args.budgets)]
        run_child(argv, os.path.join(args.out, f"ttft_{config}.log"), args.kkt_configs,
                  in_process=bool(args.budgets))


def report(out: str, configs: list[str], tokens: list[int]) -> None:
    """Table, bench_ttft.json and bench_ttft.png from the per-config results in ``out``."""
    table = {}
    for c in configs:
        path = os.path.join(out, f"ttft_{c}.json")
        table[c] = json.load(open(path)) if os.path.exists(path) else {}
    kkt, modes = ("/".join(sorted({str(table[c].get(key, default)) for c in configs if table[c]}))
                  for key, default in (("kkt_configs", "?"), ("mode", "eager")))
    print(f"TTFT (s), Qwen3.6-35B-A3B shape, dummy weights, one prefill step, {modes}; (x) = speedup vs pcp1;"
          f" GDN kkt configs: {kkt}")
    print(f"{'tokens':>8} | " + " | ".join(f"{c:>26}" for c in configs))
    for n in tokens:
        base = table.get("pcp1", {}).get(str(n), float("nan"))
        cells = []
        for c in configs:
            t = table[c].get(str(n), float("nan"))
            cells.append(f"{t:>17.3f} ({base / t:4.2f}x)")
        print(f"{n:>8} | " + " | ".join(cells))
    budgets = sorted({int(k.split("@")[1]) for c in configs for k in table[c] if "@" in k})
    for b in budgets:
        print(f"chunks of {b} tokens (x) = time / one step of the same config:")
        for n in tokens:
            chunked = {c: table[c].get(f"{n}@{b}", float("nan")) for c in configs}
            cells = [f"{t:>17.3f} ({t / table[c].get(str(n), float('nan')):4.2f}x)" for c, t in chunked.items()]
            print(f"{n:>8} | " + " | ".join(cells))
    base = table.get("pcp1", {}).get("itl_ms", float("nan"))
    itl = [table[c].get("itl_ms", float("nan")) for c in configs]
    print(f"{'ITL ms':>8} | " + " | ".join(f"{t:>17.2f} ({base / t:4.2f}x)" for t in itl))
    peaks = [table[c].get("peak_gib_per_rank", "-") for c in configs]
    print(f"{'peak GiB':>8} | " + " | ".join(f"{str(m)[:26]:>26}" for m in peaks))
    with open(os.path.join(out, "bench_ttft.json"), "w") as f:
        json.dump(table, f, indent=1)

    def draw(ax):
        for c in configs:
            for key, style in [("{}", "-"), *((f"{{}}@{b}", "--") for b in budgets)]:
                ns = [n for n in tokens if key.format(n) in table[c]]
                if ns:
                    label = c if key == "{}" else f"{c}, chunks of {key.split('@')[1]}"
                    ax.plot(ns, [table[c][key.format(n)] for n in ns], marker="o", linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s)")

    save_figure(os.path.join(out, "bench_ttft.png"), draw)


if __name__ == "__main__":
    main()
