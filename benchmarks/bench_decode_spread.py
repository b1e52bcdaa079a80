"""Decode step time: every rank decoding every request (``decode="replicated"``) against each rank
decoding its own share (``decode="spread"``), Qwen3.6-35B-A3B shape, dummy weights, one GPU.

Measured at pcp=1 on one GPU, B requests of L context tokens decoding together (each point: the
mean step over 24 decode steps, after the B prompts are prefilled and 4 steps of warm-up):
- ``graphs``: vLLM's defaults (torch.compile, CUDA graphs): the step every rank of a replicated
  decode runs at any pcp, since it computes the whole batch;
- ``no_graphs``: the compiled model without CUDA graphs, what a spread step runs (its local batch is
  none of the captured sizes).
Predicted per rank at pcp=N with spread decode: ``no_graphs`` at ceil(B/N) requests, plus the step's
collectives (``step_traffic``: one K/V all-gather per attention layer, the output rows' gather;
priced by ``predict_ttft``'s NVLink model) and the host's plan of the step (measured here: the
owners, the plan and its device tensors for B requests). Prints a table, writes JSON and a PNG:

    python benchmarks/bench_decode_spread.py --out /tmp/decode_spread            # one GPU, ~8 min
    python benchmarks/bench_decode_spread.py --out /tmp/decode_spread --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/, tests/
from benchmarks import bench_ttft, predict_ttft, step_traffic  # noqa: E402
from benchmarks.plot import log2_axes, save_figure  # noqa: E402

MODES = {"graphs": {}, "no_graphs": {"compilation_config": {"cudagraph_mode": "NONE"}}}
# context -> batch sizes (B x L within the KV cache an H200 holds beside the weights)
SWEEP = {4096: (1, 2, 4, 8, 16, 32, 64), 16384: (1, 2, 4, 8, 16, 32, 64), 65536: (1, 2, 4, 8, 16),
         131072: (1, 2, 4, 8)}
PCPS = (2, 4, 8)
STEPS, WARMUP = 24, 4
MAX_PREFILL_STEPS = 400
ATTENTION_LAYERS = 10


def measure(model: str, mode: str, sweep: dict, path: str) -> None:
    """{"L/B": mean decode step ms} (and the host plan's ms) into ``path`` after each point."""
    from vllm import SamplingParams

    longest = max(sweep)
    llm = bench_ttft.engine(model, "pcp1", longest, compiled=True, max_num_batched_tokens=32768,
                            max_num_seqs=max(max(b) for b in sweep.values()), gpu_memory_utilization=0.9,
                            max_model_len=longest + 2048, **MODES[mode])
    engine = llm.llm_engine
    out: dict = {"mode": mode}
    sp = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    for context, batches in sweep.items():
        started: set[str] = set()
        for batch in batches:
            for i in range(len(started), batch):
                rid = f"{context}-{i}"
                engine.add_request(rid, {"prompt_token_ids": [(i * 131 + j * 7919) % 200000 + 10
                                                              for j in range(context)]}, sp)
                started.add(rid)
            decoded: set[str] = set()
            for _ in range(MAX_PREFILL_STEPS):  # until every request has its first token
                decoded |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
                if decoded == started:
                    break
            else:  # the KV cache does not hold them all: the others wait
                print(f"[{mode}] L={context} B={batch}: not all requests running, stopping at this context")
                break
            for _ in range(WARMUP):
                engine.step()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                engine.step()
            out[f"{context}/{batch}"] = 1e3 * (time.perf_counter() - t0) / STEPS
            print(f"[{mode}] L={context} B={batch}: {out[f'{context}/{batch}']:.2f} ms", flush=True)
            Path(path).write_text(json.dumps(out))
        engine.abort_request(sorted(started))
        while engine.has_unfinished_requests():
            engine.step()
    out["plan_ms"] = plan_host_ms()
    Path(path).write_text(json.dumps(out))


def plan_host_ms() -> dict:
    """{"N/B": ms} the host spends on a spread step's plan: owners, ``PCPPlan``, ``PCPContext``'s device
    tensors (median of 20)."""
    import statistics
    from types import SimpleNamespace

    import numpy as np
    import torch

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.decode_owners import DecodeOwners
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.plan import PCPPlan

    out = {}
    for n in PCPS:
        for b in (1, 8, 64):
            ids, computed = [f"r{i}" for i in range(b)], np.full(b, 16384)
            requests = {r: SimpleNamespace(num_tokens=16384) for r in ids}
            owners = DecodeOwners(n)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                owner, _ = owners.step(ids, computed, np.ones(b, dtype=np.int64), computed, requests)
                plan = PCPPlan(computed, np.ones(b), n, 0, PCPConfig(decode="spread"), owner)
                PCPContext(plan, SimpleNamespace(world_size=n, rank_in_group=0), "cuda")
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            out[f"{n}/{b}"] = statistics.median(times)
    return out


def collectives_ms(n: int, batch: int) -> float:
    """A spread decode step's collectives at pcp=n (``step_traffic`` of its plan, priced as
    ``predict_ttft`` prices a split step's)."""
    import numpy as np

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.plan import PCPPlan

    owner = np.arange(batch) % n
    plan = PCPPlan(np.full(batch, 4096), np.ones(batch), n, 0, PCPConfig(decode="spread"), owner)
    shape = predict_ttft.layer_shape(1)
    calls = step_traffic.attention(plan, shape) * ATTENTION_LAYERS + step_traffic.output(plan, shape, False)
    return 1e3 * sum(predict_ttft.collective_latency_s(n) + nbytes * (n - 1) / predict_ttft.NVLINK_BYTES_PER_S
                     for _, nbytes, _ in calls)


def report(out: str) -> dict:
    data = {m: json.loads((Path(out) / f"{m}.json").read_text()) for m in MODES}
    graphs, eager = data["graphs"], data["no_graphs"]
    plan_ms = eager.get("plan_ms", {})
    rows = []
    for key in (k for k in graphs if "/" in k and k in eager):
        context, batch = map(int, key.split("/"))
        row = {"context": context, "batch": batch, "replicated_ms": graphs[key], "no_graphs_ms": eager[key]}
        for n in PCPS:
            local = f"{context}/{math.ceil(batch / n)}"
            host = plan_ms.get(f"{n}/{min((1, 8, 64), key=lambda b: abs(b - batch))}", 0.0)
            if local in eager:
                row[f"spread{n}_ms"] = eager[local] + collectives_ms(n, batch) + host
            if local in graphs:  # were a spread step to replay graphs of its local batch
                row[f"spread{n}_graphs_ms"] = graphs[local] + collectives_ms(n, batch) + host
        rows.append(row)
    lines = ["Decode step per rank (ms), Qwen3.6-35B-A3B shape, dummy weights, one H200",
             "replicated = pcp=1 with CUDA graphs (measured; every rank at any pcp); spreadN = pcp=1 without "
             "graphs at ceil(B/N) requests (measured) + collectives + host plan (predicted); (x) = replicated / spread",
             f"{'context':>8} {'B':>3} {'replicated':>11} {'no graphs':>10} "
             + " ".join(f"{'spread' + str(n):>16}" for n in PCPS)]
    for r in rows:
        cells = [f"{r[f'spread{n}_ms']:8.2f} ({r['replicated_ms'] / r[f'spread{n}_ms']:4.2f}x)"
                 if f"spread{n}_ms" in r else f"{'-':>16}" for n in PCPS]
        lines.append(f"{r['context']:>8} {r['batch']:>3} {r['replicated_ms']:11.2f} {r['no_graphs_ms']:10.2f} "
                     + " ".join(cells))
    lines += ["", "spreadN with CUDA graphs of the local batch (not built; predicted: replicated at ceil(B/N) + the "
              "same collectives and host plan)",
              f"{'context':>8} {'B':>3} {'replicated':>11} " + " ".join(f"{'spread' + str(n):>16}" for n in PCPS)]
    for r in rows:
        cells = [f"{r[f'spread{n}_graphs_ms']:8.2f} ({r['replicated_ms'] / r[f'spread{n}_graphs_ms']:4.2f}x)"
                 if f"spread{n}_graphs_ms" in r else f"{'-':>16}" for n in PCPS]
        lines.append(f"{r['context']:>8} {r['batch']:>3} {r['replicated_ms']:11.2f} " + " ".join(cells))
    lines.append("host plan of a spread step (ms, measured): "
                 + ", ".join(f"pcp{k.split('/')[0]} B={k.split('/')[1]}: {v:.2f}" for k, v in plan_ms.items()))
    table = "\n".join(lines)
    print(table)
    (Path(out) / "table.txt").write_text(table + "\n")
    (Path(out) / "bench_decode_spread.json").write_text(json.dumps(rows, indent=1))

    def draw(ax):
        for context in sorted({r["context"] for r in rows}):
            for key, style, what in (("spread2_ms", "-", "as built"), ("spread2_graphs_ms", "--", "local graphs")):
                pts = [r for r in rows if r["context"] == context and key in r]
                ax.plot([r["batch"] for r in pts], [r["replicated_ms"] / r[key] for r in pts], style, marker="o",
                        label=f"pcp=2, {context // 1024}k, {what}")
        ax.axhline(1.0, color="gray", lw=0.8)
        log2_axes(ax, "requests decoding (B)", "replicated / spread step time",
                  "Spread decode per rank, pcp=2 (predicted)")

    save_figure(str(Path(out) / "decode_spread.png"), draw)
    return {"rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/decode_spread")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(SWEEP))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sweep = {c: SWEEP[c] for c in args.contexts}
    if args.child:
        mode, model = args.child
        measure(model, mode, sweep, str(Path(args.out) / f"{mode}.json"))
        return
    if not args.report_only:
        model = bench_ttft.checkpoint(args.out)
        for mode in args.modes:
            bench_ttft.run_child([__file__, "--out", args.out, "--contexts", *map(str, args.contexts),
                                  "--child", mode, model], str(Path(args.out) / f"{mode}.log"), "race_free",
                                 in_process=True)
    if all((Path(args.out) / f"{m}.json").exists() for m in MODES):
        report(args.out)


if __name__ == "__main__":
    main()
