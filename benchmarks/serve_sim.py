# SPDX-License-Identifier: Apache-2.0
"""Time to first token and inter-token latency under load, predicted: vLLM 0.20.2's own scheduler on a
virtual clock, each step priced by the step-time model (``predict_ttft.ServingStepModel``).

    python benchmarks/serve_sim.py run --layouts pcp1 pcp2 pcp4 pcp8 tp2 tp4 tp8 tp2-pcp4 dp8 \\
        --prompt-len 16384:131072 --output-len 256 --rate 0.5 --num-requests 200 [--mtp 3] --out DIR
    python benchmarks/serve_sim.py plan --gpus 8 --model qwen3.6-35b-a3b --prompt-len 16384:131072 \\
        --output-len 256 --rate 0.5 [--mtp 3 --accept 0.7] [--itl-p99 100]

A layout is tp x pcp x dp GPUs: ``dp`` independent engines (N ``vllm serve`` processes behind a router that
sends each request to the engine with the lowest waiting x 4 + running, vLLM's own data-parallel rule; vLLM's
``-dp`` for a MoE model would also tie the replicas' MoE layers together, which is not modelled), each of tp x
pcp GPUs. Each engine's KV cache is what one of its GPUs leaves: ``--gpu-memory-utilization`` of the card
less the weights (the experts as the doctor counts them, ``expert_memory.whole_experts_bytes``, whole on
every PCP rank and split over TP; the rest split over TP) less ``RESERVE`` (activations, CUDA graphs,
NCCL: assumed). Requests come from ``serve_sim_traffic``; the engine half is ``serve_sim_engine``.

Every number it prints is predicted. TTFT adds vLLM's first-token detokenization (pcp=1: from the whole
prompt; pcp > 1: the prompt's tail, left out), ITL is the gap between two outputs of a request that carry
tokens (what ``vllm bench serve`` records: with MTP one output per step holds 1 + accepted tokens), TPOT
(time per output token after the first) and end-to-end latency as bench serve computes them.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/
from benchmarks import serve_sim_traffic as traffic  # noqa: E402
from benchmarks.plot import log_log_axes, save_figure  # noqa: E402
from benchmarks.predict_ttft import GPUS, Config, Rows, ServingStepModel, weight_bytes  # noqa: E402
from benchmarks.serve_sim_engine import EngineShape, Replica  # noqa: E402

RESERVE = 5 << 30  # per GPU beside weights and KV: activations of the profile run, CUDA graphs, NCCL (assumed)
RESERVE_PER_TOKEN = 96 << 10  # activations grow with the step's tokens beyond 8192 (assumed)
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "itl", "tpot", "e2el")
SIZES = (1, 2, 4, 8)


class Layout(NamedTuple):
    tp: int = 1
    pcp: int = 1
    dp: int = 1
    gdn: str = "relay"

    @property
    def gpus(self) -> int:
        return self.tp * self.pcp * self.dp

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pcp", self.pcp), ("dp", self.dp)) if v > 1]
        return "-".join(parts) or "pcp1"

    def config(self) -> Config:
        """The step-time model's config of one engine (the plugin's defaults: relay, whole experts)."""
        return Config(self.pcp, self.tp, self.gdn if self.pcp > 1 else None, "whole" if self.pcp > 1 else None)


def parse_layout(spec: str) -> Layout:
    """``pcp4``, ``tp2-pcp4``, ``dp2-tp2-pcp2`` (any order; left out: 1)."""
    parts = {k: int(v) for k, v in re.findall(r"(tp|pcp|dp)(\d+)", spec)}
    if not parts or re.sub(r"(tp|pcp|dp)\d+|[-x_. ]", "", spec):
        raise ValueError(f"layout {spec!r}: write it as tpN-pcpN-dpN (any of them, e.g. tp2-pcp4)")
    return Layout(parts.get("tp", 1), parts.get("pcp", 1), parts.get("dp", 1))


def layouts_for(gpus: int) -> list[Layout]:
    """Every tp x pcp x dp = ``gpus`` with tp and pcp in 1, 2, 4, 8."""
    return [Layout(tp, pcp, gpus // (tp * pcp)) for tp, pcp in itertools.product(SIZES, SIZES)
            if gpus % (tp * pcp) == 0]


def kv_bytes(layout: Layout, gpu: str, mtp: int, budget: int, utilization: float = 0.9, layers: int = 40,
             preset: str = "qwen3.6-35b-a3b") -> int:
    """The KV cache memory of one GPU of ``layout`` with the model's first ``layers`` layers (negative: the
    weights do not fit)."""
    from qwen36_pcp.config import MTP_METHOD
    from qwen36_pcp.doctor import model_config_like, read_model_config
    from qwen36_pcp.expert_memory import whole_experts_bytes

    like = model_config_like(read_model_config(preset))
    like.hf_text_config.num_hidden_layers = layers
    spec = SimpleNamespace(method=MTP_METHOD) if mtp else None
    experts = whole_experts_bytes(SimpleNamespace(model_config=like, speculative_config=spec), layout.tp)
    w = weight_bytes(layout.tp, layers)
    rest = w["dense"] + w["lm_head"] + w["embedding"] + (w["mtp_dense"] if mtp else 0)
    reserve = RESERVE + RESERVE_PER_TOKEN * max(0, budget - 8192)
    return int(utilization * GPUS[gpu].memory_bytes - experts - rest - reserve)


@functools.lru_cache(maxsize=8)
def step_model(gpu: str, layers: int) -> ServingStepModel:
    return ServingStepModel(gpu, layers)


class Options(NamedTuple):
    budget: int = 8192
    mtp: int = 0
    accept: float = 0.7
    gpu: str = "h200"
    layers: int = 40
    max_num_seqs: int = 1024
    async_scheduling: bool = True
    prefix_caching: bool | None = None
    utilization: float = 0.9
    kv_bytes: int | None = None  # per GPU; None: what the layout's GPUs leave


def simulate(layout: Layout, arrivals: list, opt: Options | None = None) -> dict:
    """Every request of ``arrivals`` through ``layout``'s engines; the metrics (``summarize``)."""
    wall, opt = time.perf_counter(), opt or Options()
    kv = opt.kv_bytes or kv_bytes(layout, opt.gpu, opt.mtp, opt.budget, opt.utilization, opt.layers)
    longest = max(a.prompt + a.output for a in arrivals)
    if kv <= 0:
        return {"layout": layout.name, "fits": False, "kv_gib_per_gpu": kv / 2**30}
    shape = EngineShape(tp=layout.tp, budget=opt.budget, max_num_seqs=opt.max_num_seqs,
                        max_model_len=-(-(longest + 1 + opt.mtp) // 1024) * 1024, kv_bytes=kv, mtp=opt.mtp,
                        prefix_caching=opt.prefix_caching, async_scheduling=opt.async_scheduling, layers=opt.layers)
    model, cfg = step_model(opt.gpu, opt.layers), layout.config()

    def step_time(rows):
        return model.batch_step(cfg, rows, opt.mtp)

    try:
        replicas = [Replica(shape, step_time, Rows, opt.accept, seed=i) for i in range(layout.dp)]
    except ValueError as e:  # vLLM's own refusal, e.g. the KV cache cannot hold one longest request
        return {"layout": layout.name, "fits": False, "kv_gib_per_gpu": kv / 2**30, "why": str(e).splitlines()[0]}
    for i, a in enumerate(sorted(arrivals)):
        for r in replicas:
            r.advance(a.time)
        min(replicas, key=Replica.load).add(f"r{i}", a)
    for r in replicas:
        r.advance(math.inf)
    unfinished = sum(rec.finished is None for r in replicas for rec in r.records.values())
    if unfinished:
        raise RuntimeError(f"{layout.name}: {unfinished} requests never finished (vLLM could not schedule them)")
    out = summarize(replicas, model, cfg)
    out.update(layout=layout.name, fits=True, kv_gib_per_gpu=kv / 2**30, budget=opt.budget, mtp=opt.mtp,
               sim_wall_s=time.perf_counter() - wall, num_blocks=replicas[0].setup["num_blocks"])
    return out


def summarize(replicas: list[Replica], model: ServingStepModel, cfg: Config) -> dict:
    recs = [rec for r in replicas for rec in r.records.values()]
    ttft = [rec.token_times[0] - rec.arrival + model.detokenize_s(cfg, rec.prompt) for rec in recs]
    itl = [b - a for rec in recs for a, b in zip(rec.token_times, rec.token_times[1:])]
    tpot = [(rec.finished - rec.token_times[0]) / (rec.tokens - 1) for rec in recs if rec.tokens > 1]
    e2el = [rec.finished - rec.arrival for rec in recs]
    out = {"requests": len(recs)}
    for name, values in zip(METRICS, (ttft, itl, tpot, e2el)):
        values = np.asarray(values or [0.0])
        out[name] = {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES},
                     "max": float(values.max())}
    span = max(rec.finished for rec in recs) - min(rec.arrival for rec in recs)
    out["output_tok_s"] = sum(rec.tokens for rec in recs) / span
    out["request_s"] = len(recs) / span
    steps = [s for r in replicas for s in r.steps]
    busy = sum(s.end - s.start for s in steps) or 1.0
    out["kv_usage"] = {"mean": sum(s.kv_usage * (s.end - s.start) for s in steps) / busy,
                       "max": max(s.kv_usage for s in steps)}
    out["steps"] = {k: {"count": sum(s.kind == k for s in steps),
                        "time_share": sum(s.end - s.start for s in steps if s.kind == k) / busy,
                        "split": sum(s.split for s in steps if s.kind == k)}
                    for k in ("prefill", "mixed", "decode", "verify")}
    out["preempted"] = sum(s.preempted for s in steps)
    return out


# ------------------------------------------------------------------------------------------------ output
HEADER = (f"{'layout':>14} {'budget':>6} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p90':>6} {'p99':>6}"
          f" {'max':>6}"
          f" {'TPOT p50':>8} {'E2E p99':>8} {'tok/s':>6} {'KV GiB':>6} {'KV max':>6}  steps: prefill/mixed/decode"
          f"/verify (split)")


def row(r: dict) -> str:
    if not r["fits"]:
        why = r.get("why") or f"{r['kv_gib_per_gpu']:.1f} GiB left for KV per GPU"
        return f"{r['layout']:>14}  does not fit: {why}"
    s = r["steps"]
    mix = "/".join(str(s[k]["count"]) for k in ("prefill", "mixed", "decode", "verify"))
    split = sum(s[k]["split"] for k in s)
    t, i = r["ttft"], r["itl"]
    return (f"{r['layout']:>14} {r['budget']:>6} {t['p50']:>8.2f}s {t['p90']:>6.2f}s {t['p99']:>6.2f}s"
            f" {i['p50'] * 1e3:>6.1f}ms {i['p90'] * 1e3:>6.0f} {i['p99'] * 1e3:>6.0f} {i['max'] * 1e3:>6.0f}"
            f" {r['tpot']['p50'] * 1e3:>6.1f}ms"
            f" {r['e2el']['p99']:>7.1f}s {r['output_tok_s']:>6.0f} {r['kv_gib_per_gpu']:>6.1f}"
            f" {r['kv_usage']['max']:>6.0%}  {mix} ({split})"
            + (f" preempted {r['preempted']}" if r["preempted"] else ""))


def describe(args, arrivals) -> str:
    where = args.trace or args.dataset or f"prompts {args.prompt_len}, outputs {args.output_len} tokens"
    rate = "from the trace" if args.trace else f"{args.rate} req/s (Poisson)"
    mtp = f"MTP K={args.mtp}, each draft accepted with p={args.accept}" if args.mtp else "no MTP"
    return (f"predicted (serve_sim: vLLM 0.20.2's scheduler, step-time model): {len(arrivals)} requests, {where},"
            f" {rate}; {mtp}; {args.gpu.upper()}, {args.layers} layers, {'async' if not args.sync else 'sync'}"
            f" scheduling")


def plot(results: list[dict], path: str, title: str) -> None:
    """TTFT p99 against ITL p99, one colour per layout, one marker per budget (log axes)."""
    fitting = [r for r in results if r["fits"]]
    names = list(dict.fromkeys(r["layout"] for r in fitting))
    budgets = sorted({r["budget"] for r in fitting})

    def draw(ax):
        import matplotlib.pyplot as plt

        colors = plt.get_cmap("tab20")
        for r in fitting:
            i, j = names.index(r["layout"]), budgets.index(r["budget"])
            ax.scatter(r["itl"]["p99"] * 1e3, r["ttft"]["p99"], color=colors(i % 20), marker="os^D"[j % 4],
                       label=r["layout"] if j == 0 else None)
        for j, b in enumerate(budgets):
            ax.scatter([], [], color="gray", marker="os^D"[j % 4], label=f"budget {b}")
        log_log_axes(ax, "ITL p99 (ms), predicted", "TTFT p99 (s), predicted", title)
    save_figure(path, draw, fontsize=6, ncol=2)


def arrivals_of(args) -> list:
    if args.trace:
        return traffic.from_trace(args.trace)
    if args.dataset:
        return traffic.from_dataset(args.dataset, args.num_requests, args.rate, args.seed, args.tokenizer,
                                    int(args.output_len) if args.output_len else None)
    return traffic.synthetic(args.num_requests, args.rate, args.prompt_len, args.output_len or "256", args.seed)


def options(args, budget: int) -> Options:
    return Options(budget=budget, mtp=args.mtp, accept=args.accept, gpu=args.gpu, layers=args.layers,
                   max_num_seqs=args.max_num_seqs, async_scheduling=not args.sync,
                   prefix_caching={"on": True, "off": False}.get(args.prefix_caching),
                   utilization=args.gpu_memory_utilization,
                   kv_bytes=int(args.kv_gib * 2**30) if args.kv_gib else None)


def rank(results: list[dict], itl_p99: float | None) -> list[dict]:
    """Fitting layouts that meet the ITL (p99, s) first, each group by TTFT p99."""
    def key(r):
        return (not r["fits"], itl_p99 is not None and r["itl"]["p99"] > itl_p99, r["ttft"]["p99"] if r["fits"] else 0)
    return sorted(results, key=key)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("run", "plan"):
        p = sub.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if name == "run":
            p.add_argument("--layouts", nargs="+", default=["pcp1"], help="e.g. pcp4 tp2 tp2-pcp4 dp8")
            p.add_argument("--budget", type=int, nargs="+", default=[8192], help="max_num_batched_tokens")
        else:
            p.add_argument("--gpus", type=int, required=True)
            p.add_argument("--budget", type=int, nargs="+", default=[8192, 16384, 32768],
                           help="max_num_batched_tokens values to try for every layout")
            p.add_argument("--itl-p99", type=float, default=None, metavar="MS", help="required ITL p99 (ms)")
            p.add_argument("--top", type=int, default=10)
        p.add_argument("--model", default="qwen3.6-35b-a3b", choices=["qwen3.6-35b-a3b"],
                       help="the step-time model's shape")
        p.add_argument("--prompt-len", default="32768", help="N, LO:HI, A,B,C or lognormal:MEDIAN:SIGMA[:MAX]")
        p.add_argument("--output-len", default=None, help="as --prompt-len (default 256; a dataset's own)")
        p.add_argument("--rate", type=float, default=1.0, help="requests/s of the whole deployment (inf: a burst)")
        p.add_argument("--num-requests", type=int, default=200)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--trace", help="JSONL {time, prompt, output} or a vllm bench serve --save-detailed result")
        p.add_argument("--dataset", help="a vllm bench serve dataset file (custom .jsonl or ShareGPT .json)")
        p.add_argument("--tokenizer", help="count a dataset's tokens with this (local) tokenizer")
        p.add_argument("--mtp", type=int, default=0, metavar="K", help="MTP drafts per step")
        p.add_argument("--accept", type=float, default=0.7, help="probability each MTP draft is accepted")
        p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
        p.add_argument("--layers", type=int, default=40, help="the model's first LAYERS layers")
        p.add_argument("--max-num-seqs", type=int, default=1024)
        p.add_argument("--sync", action="store_true", help="vLLM's synchronous scheduler (default: async)")
        p.add_argument("--prefix-caching", choices=["on", "off", "default"], default="default")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        p.add_argument("--kv-gib", type=float, default=None, help="KV cache per GPU (default: what it leaves)")
        p.add_argument("--out", default=None, help="folder for table.txt, results.json, serve_sim.png, trace.jsonl")
    args = ap.parse_args(argv)
    arrivals = arrivals_of(args)
    layouts = [parse_layout(s) for s in args.layouts] if args.command == "run" else layouts_for(args.gpus)
    title = describe(args, arrivals)
    print(title)
    if args.command == "run":
        print(HEADER)
    results = []
    for layout, budget in itertools.product(layouts, args.budget):
        results.append(simulate(layout, arrivals, options(args, budget)))
        if args.command == "run":
            print(row(results[-1]), flush=True)
    lines = [title, HEADER] + [row(r) for r in results]
    if args.command == "plan":
        limit = args.itl_p99 / 1e3 if args.itl_p99 else None
        ranked = rank(results, limit)[:args.top]
        need = f"ITL p99 <= {args.itl_p99:g} ms" if limit else "no ITL requirement"
        lines = [title, f"ranked by TTFT p99 (predicted), {need}:", "rank " + HEADER]
        for i, r in enumerate(ranked, 1):
            miss = " (misses the ITL)" if limit and r["fits"] and r["itl"]["p99"] > limit else ""
            lines.append(f"{i:>4} {row(r)}{miss}")
        print("\n".join(lines[1:]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/serve_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)
        (out / "table.txt").write_text(f"$ {command}\n" + "\n".join(lines) + "\n")
        (out / "results.json").write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
        traffic.write_trace(arrivals, str(out / "trace.jsonl"))  # replays exactly with --trace
        plot(results, str(out / "serve_sim.png"), title.split(": ", 1)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
