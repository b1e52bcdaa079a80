# SPDX-License-Identifier: Apache-2.0
"""Decode step per rank: every rank decoding every request (``decode="replicated"``) against each rank
decoding its own share (``decode="spread"``: its own requests as vLLM's batch, through vLLM's CUDA graph
of that batch).

Qwen3.6-35B-A3B shape with its first ``--layers`` layers (default 8, 2 x [3 GDN + 1 attention]: four
ranks' weights fit one GPU; 24 fit two ranks on an H200), dummy weights, vLLM's defaults (torch.compile,
CUDA graphs). Every rank of an engine runs on one GPU and the ranks take turns
(``harness/shared_gpu.py``): a rank holds the GPU while it runs and gives it up (its kernels finished)
while it waits in a collective, so the time it holds the GPU in a step, its **turn time**, is its own
step on a GPU of its own, host included, collectives left out.

Configs: ``pcp1`` (the step every rank of a replicated decode runs at any pcp: the whole batch),
``pcp2_spread``, ``pcp4_spread``, and the control ``pcp2_replicated`` / ``pcp4_replicated``: pcp=1's
step on every rank plus one gather of the sampled rows, whose turns against pcp=1's show what taking
turns adds to a step of more than one rank (``control_lines``). Each point: B requests of L context
tokens decoding together, the median over 24 steps after 4 warm-up steps of each rank's turn time per step
(measured). A spread rank's
turn holds its collective's copies through host memory, which NCCL between GPUs does not make; the
shared GPU's communicator times them (``turn_counters``: the GPU drained first, the wait for the
other ranks left out). A spread rank's step on a GPU of its own: its turn time less those copies, plus
the step's collective (``step_traffic`` of the spread plan, priced by ``predict_ttft``'s NVLink model).
A rank drains its GPU at each collective and at its turn's end, so the GPU work left when its host
stopped adds to the host's time, where vLLM's async scheduling on a GPU of its own would hide the host
behind it; those waits are timed too, and a second table gives lower bounds with the host's work
hidden: per rank max(host busy, GPU work left).
Each rank also records the kind of every step (``owned_full``: a spread decode step through vLLM's
FULL graph of its own requests) and its host's time by phase over the measured steps (vLLM's and the
plugin's runner steps, host busy, no profiler: ``host_phases``). Prints a table, writes JSON and a PNG:

    python benchmarks/bench_decode_spread.py --out /tmp/decode_spread            # one GPU, ~8 min
    python benchmarks/bench_decode_spread.py --out /tmp/decode_spread --report-only
    python benchmarks/bench_decode_spread.py --out /tmp/ds_24 --layers 24 --configs pcp1 pcp2_spread  # more layers
    python benchmarks/bench_decode_spread.py --out /tmp/ds_long --shared-prefix --contexts 4096 32768 131072 \
        --batches 1 8 64   # long contexts: one shared prompt per context from the prefix cache
    python benchmarks/bench_decode_spread.py --out /tmp/ds_profile --configs pcp2_spread pcp1_piecewise \
        --contexts 4096 --profile      # where a step's time goes: torch profiler traces, per rank
    python benchmarks/bench_decode_spread.py --out /tmp/ds_mtp --mtp --contexts 4096   # verification steps

``--mtp`` runs every config with the checkpoint's MTP head drafting ``bench_mtp.K`` tokens: each step
verifies 1 + K rows per request (spread: the rank's own requests as vLLM's uniform batch of such
queries). Dummy weights give random drafts, none accepted, so every step is a full verification step
of one token per request (``tokens_per_step`` records it). One ``--out`` per setting: the report's
model takes one layer count and one draft count.

``--profile`` also records 8 decode steps of 16 requests of 4k tokens under vLLM's torch profiler and
reports per rank and step: the GPU's busy time against the span of its kernels (the rest: the GPU
waiting for the host), and the host time of vLLM's custom ops (the attention, GDN and K/V-write ops
that run between the graphs; ``CUDAGraph`` replays) by name; then 8 more under cProfile in every worker
(``profile_host``): the host's Python by function, per rank (``<config>_traces/host.rank<r>.txt``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/, tests/, harness/
from benchmarks import bench_ttft, predict_ttft, step_traffic  # noqa: E402
from benchmarks.bench_mtp import K as MTP_DRAFTS  # noqa: E402
from benchmarks.plot import log2_axes, save_figure  # noqa: E402

DEFAULT_LAYERS = 8  # --layers
RANK_ALLOWANCE_BYTES = 9 << 30  # rank_bytes: one rank's memory besides its weights and KV cache (28 layers, FP8,
# 64 requests: a rank held 40.2 GiB, 24.0 of weights and 8 of KV, when the other ran out on one H100)
SPREAD = {"decode": "spread", "min_split_tokens": 1 << 20}  # prompts replicated: a quick prefill here
# the control: replicated decode at pcp > 1 is pcp=1's step plus one gather of the sampled rows, so its
# turns against pcp=1's show what taking turns on the shared GPU adds to a step of more than one rank
REPLICATED = {**SPREAD, "decode": "replicated"}
CONFIGS = {"pcp1": 1, "pcp2_spread": 2, "pcp4_spread": 4, "pcp1_piecewise": 1, "pcp2_replicated": 2,
           "pcp4_replicated": 4}  # -> ranks
DEFAULT_CONFIGS = ("pcp1", "pcp2_spread", "pcp4_spread")
# context -> batch sizes
SWEEP = {4096: (1, 2, 4, 8, 16, 32, 64, 128), 16384: (1, 4, 16), 32768: (1, 8, 64, 128), 131072: (1, 8, 64, 128)}
DEFAULT_CONTEXTS = (4096, 16384)
# --shared-prefix: every request of a context is one shared prompt of all but its last TAIL tokens, read
# from vLLM's prefix cache after one prefill of its own
TAIL = 64
STEPS, WARMUP = 24, 4
PROFILE_POINT, PROFILE_STEPS = (4096, 16), 8
HOST_PROFILE_TOP = 25
MAX_PREFILL_STEPS = 400

def engine_args(config: str, drafts: int = 0) -> dict:
    ranks = CONFIGS[config]
    args = dict(prefill_context_parallel_size=ranks, **bench_ttft.shared_gpu_args(ranks))
    if drafts:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": drafts}
    if ranks > 1:
        args["additional_config"] = {"qwen36_pcp": REPLICATED if config.endswith("_replicated") else SPREAD}
    if config == "pcp1_piecewise":  # vLLM's PIECEWISE graphs alone (attention and GDN eager between them)
        args["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    return args


def prompt_ids(context: int, request: int, shared_prefix: bool) -> list[int]:
    """Request ``request``'s ``context`` prompt tokens; with ``shared_prefix`` all but the last ``TAIL``
    are the same for every request of that context (and ids 10.. keep off the special tokens)."""
    def ids(i, lo, hi):
        return [(i * 131 + j * 7919) % 200000 + 10 for j in range(lo, hi)]

    if not shared_prefix:
        return ids(request, 0, context)
    return ids(0, 0, context - TAIL) + ids(request + 1, context - TAIL, context)


def run_until_first_tokens(engine, started: set[str]) -> dict[str, int] | None:
    """Step until every request in ``started`` has its first token: {request: its prompt tokens read
    from the prefix cache} of those that got it meanwhile (None: the KV cache does not hold them all
    within ``MAX_PREFILL_STEPS`` steps)."""
    cached: dict[str, int] = {}
    for _ in range(MAX_PREFILL_STEPS):
        for o in engine.step():
            if o.outputs and o.outputs[0].token_ids and o.request_id not in cached:
                cached[o.request_id] = o.num_cached_tokens or 0
        if started <= cached.keys():
            return cached
    return None


def measure(model: str, config: str, sweep: dict, path: str, trace_dir: str | None = None,
            shared_prefix: bool = False, layers: int = DEFAULT_LAYERS, drafts: int = 0) -> None:
    """{"L/B": {"turn_ms": [per rank], "wall_ms": ms}} into ``path`` after each point; with
    ``trace_dir``, ``PROFILE_STEPS`` steps at ``PROFILE_POINT`` under vLLM's torch profiler too. With
    ``shared_prefix`` (prefix caching on) each context's shared prompt is prefilled once, alone, and
    every request then reads it from the cache: long contexts for many requests in little KV memory and
    prefill time. Each request's attention reads its whole context's K/V, as distinct contexts would,
    but from blocks the others read too, which the GPU's L2 cache can serve where distinct contexts
    come from HBM (compare a context with and without it); prefix caching also adds its own per-step
    work (vLLM's state copies at block ends, the spread step's state-block broadcasts). Each point
    records the fewest prompt tokens its new requests read from the cache (``cached_tokens``), and the
    tokens each request gained per measured step (``tokens_per_step``; with ``drafts``: 1 + the drafts
    accepted)."""
    from vllm import SamplingParams

    from benchmarks.host_phases import host_phases, start_host_phases
    from benchmarks.profile_host import start_worker_profile, stop_worker_profile
    from harness.shared_gpu import turn_counters

    longest = max(sweep)
    # bench_ttft's pcp1 engine, made this config's by engine_args (its pcp size, the shared GPU)
    llm = bench_ttft.engine(model, "pcp1", longest, compiled=True, max_num_batched_tokens=32768,
                            max_num_seqs=max(max(b) for b in sweep.values()),
                            max_model_len=longest + 2048, enable_prefix_caching=shared_prefix,
                            **engine_args(config, drafts),
                            **bench_ttft.profiler_args(trace_dir))
    engine = llm.llm_engine
    fp8 = "quantization_config" in json.loads((Path(model) / "config.json").read_text())
    out: dict = {"config": config, "shared_prefix": shared_prefix, "layers": layers, "drafts": drafts, "fp8": fp8,
                 "gpu": gpu_query("name") or "?"}
    sp = SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0)
    for context, batches in sweep.items():
        started: set[str] = set()
        if shared_prefix:  # the shared prompt alone into the cache first, so that every request hits it
            # (its GDN states are kept at its last full block: inside the shared part)
            engine.add_request(f"{context}-prefix", {"prompt_token_ids": prompt_ids(context, 0, True)[:-TAIL]},
                               SamplingParams(max_tokens=1))
            run_until_first_tokens(engine, {f"{context}-prefix"})
        for batch in batches:
            new = set()
            for i in range(len(started), batch):
                rid = f"{context}-{i}"
                engine.add_request(rid, {"prompt_token_ids": prompt_ids(context, i, shared_prefix)}, sp)
                new.add(rid)
            started |= new
            cached = run_until_first_tokens(engine, started)
            if cached is None:  # the others wait
                print(f"[{config}] L={context} B={batch}: not all requests running, stopping at this context")
                break
            for _ in range(WARMUP):
                engine.step()
            llm.collective_rpc(start_host_phases)
            marks, generated = [llm.collective_rpc(turn_counters)], {}
            for _ in range(STEPS):
                for o in engine.step():
                    if o.outputs:
                        generated.setdefault(o.request_id, []).append(len(o.outputs[0].token_ids))
                marks.append(llm.collective_rpc(turn_counters))
            point = per_step_medians(marks)
            # each request's tokens over the steps after its first output here, per step
            gained = [(n[-1] - n[0]) / (len(n) - 1) for n in generated.values() if len(n) > 1]
            point["tokens_per_step"] = sum(gained) / len(gained) if gained else None
            point["cached_tokens"] = min((cached[r] for r in new if r in cached), default=None)
            point["phases_ms"] = [{k: ms / STEPS for k, (ms, _) in r.items()}
                                  for r in llm.collective_rpc(host_phases)]
            out[f"{context}/{batch}"] = point
            print(f"[{config}] L={context} B={batch}: turn {max(point['turn_ms']):.2f} ms per rank (max of the "
                  f"ranks' medians)", flush=True)
            Path(path).write_text(json.dumps(out))
            if trace_dir and (context, batch) == PROFILE_POINT:
                llm.start_profile()
                for _ in range(PROFILE_STEPS):
                    engine.step()
                llm.stop_profile()
                llm.collective_rpc(start_worker_profile)
                for _ in range(PROFILE_STEPS):
                    engine.step()
                out["host_profile"] = llm.collective_rpc(stop_worker_profile,
                                                         args=(f"{trace_dir}/host", PROFILE_STEPS))
        engine.abort_request(sorted(started))
        while engine.has_unfinished_requests():
            engine.step()
    if config == "pcp1":
        out["plan_ms"] = plan_host_ms()
    Path(path).write_text(json.dumps(out))


def per_step_medians(marks: list[list[dict]]) -> dict:
    """Each rank's times per step, the median over the steps (a one-off stall, such as a kernel compiled
    on first use, does not move it), from the readings of ``turn_counters`` (per rank) taken before the
    first step and after each: the turn, its copies through host memory (``staging``), its waits for
    the GPU (``drain``), the turn less the copies (``own``: the step on a GPU of its own with nothing
    hidden) and less the waits too (``host``: the host busy)."""
    import statistics

    def steps(rank: int, value) -> list[float]:
        return [1e3 * (value(b[rank]) - value(a[rank])) for a, b in zip(marks, marks[1:])]

    parts = {"turn": lambda c: c["turn"], "own": lambda c: c["turn"] - c["staging"],
             "staging": lambda c: c["staging"], "drain": lambda c: c["drain"],
             "host": lambda c: c["turn"] - c["staging"] - c["drain"]}
    ranks = range(len(marks[0]))
    point = {f"{k}_ms": [statistics.median(steps(r, v)) for r in ranks] for k, v in parts.items()}
    point["turn_mean_ms"] = [statistics.fmean(steps(r, parts["turn"])) for r in ranks]
    return point


def summarize_profile(trace_dir: str, top: int = 8) -> dict:
    """Per rank and step: GPU busy and span (``profile_prefill.summarize_trace``) and the host time of
    the custom ops and graph replays by name (their own spans on the host)."""
    from benchmarks.profile_prefill import summarize_trace, traces

    out = {}
    for label, events in traces(trace_dir):
        gpu = summarize_trace(events)
        if not gpu:
            continue
        host: dict[str, float] = {}
        for e in events:
            name = e.get("name", "")
            if e.get("ph") == "X" and e.get("cat") == "cpu_op" and (name.startswith("vllm::")
                                                                   or "CUDAGraph" in name):
                host[name] = host.get(name, 0.0) + e["dur"] / 1e3 / PROFILE_STEPS
        out[label] = {"gpu_busy_ms": gpu["busy_ms"] / PROFILE_STEPS, "gpu_span_ms": gpu["span_ms"] / PROFILE_STEPS,
                      "host_ops_ms": dict(sorted(host.items(), key=lambda kv: -kv[1])[:top])}
    return out


def plan_host_ms() -> dict:
    """{"N/B": ms} the host spends on the plan of a batch's first spread step: owners, ``PCPPlan``,
    ``PCPContext``'s device tensors (median of 20; already inside the turn times; the batch's later
    steps reuse the plan and tensors: ``StepPlanner.plan``)."""
    import statistics
    from types import SimpleNamespace

    import numpy as np
    import torch

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.plan import PCPPlan
    from qwen36_pcp.spread.decode_owners import DecodeOwners

    out = {}
    for n in (2, 4, 8):
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


def graph_rows(rows: int) -> int:
    """The size of the CUDA graph a batch of ``rows`` decode rows replays under vLLM's default capture
    sizes (1, 2, 4, then multiples of 8 up to 256, of 16 beyond): the step's gather moves that many."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # vLLM 0.20.2's config/vllm.py
    return next((s for s in sizes if s >= rows), rows)


def collectives_ms(n: int, batch: int, attention_layers: int, drafts: int = 0) -> float:
    """A spread decode step's collectives at pcp=n (``step_traffic`` of its plan, priced as
    ``predict_ttft`` prices a split step's) in a model of ``attention_layers``; with ``drafts``, a
    verification step: 1 + drafts rows per request, every row gathered (the rejection sampler reads
    them all)."""
    import numpy as np

    from qwen36_pcp.config import PCPConfig
    from qwen36_pcp.plan import PCPPlan

    owner, query = np.arange(batch) % n, 1 + drafts
    plan = PCPPlan(np.full(batch, 4096), np.full(batch, query), n, 0, PCPConfig(decode="spread"), owner,
                   min_rows=graph_rows(math.ceil(batch / n) * query))
    shape = predict_ttft.layer_shape(1)
    calls = step_traffic.attention(plan, shape) * attention_layers + step_traffic.output(plan, shape, drafts > 0,
                                                                                        attention_layers)
    return 1e3 * sum(predict_ttft.collective_latency_s(n) + nbytes * (n - 1) / predict_ttft.NVLINK_BYTES_PER_S
                     for _, nbytes, _ in calls)


PREDICT_CONTEXTS, PREDICT_BATCHES = (16384, 65536, 131072), (1, 8, 16, 64)
# a decode row reads its context's K/V in every attention layer: 2 KV heads x 256 x (K, V) x bf16
KV_BYTES_PER_TOKEN_LAYER = 2 * 256 * 2 * 2
HBM_BYTES_PER_S = 0.8 * 4.8e12  # H200, 80% of peak


def kv_read_ms(rows: int, context: int, attention_layers: int) -> float:
    """The attention layers' K/V reads of ``rows`` decode rows of ``context`` tokens, at HBM speed."""
    return 1e3 * rows * context * KV_BYTES_PER_TOKEN_LAYER * attention_layers / HBM_BYTES_PER_S


def fit_line(pts: list[tuple[int, int, float]], attention_layers: int | None) -> dict:
    """t = a + b x (+ with ``attention_layers``, their K/V reads of x rows of context L at HBM speed,
    too small to fit at these contexts) by least squares over the points (x, L, t). When the worst point
    is more than 50% off, the one point whose leaving out fits the others best is left out
    (``dropped``)."""
    import numpy as np

    x, ctx, t = (np.array(v, dtype=float) for v in zip(*pts))
    y = t - np.array([kv_read_ms(int(a), int(c), attention_layers) if attention_layers else 0.0
                      for a, c in zip(x, ctx)])
    design = np.stack([np.ones_like(x), x], axis=1)

    def fit(keep):
        coef = np.linalg.lstsq(design[keep], y[keep], rcond=None)[0]
        return coef, float(np.max((np.abs(design @ coef - y) / np.abs(t))[keep]))

    keep, dropped = np.ones(len(x), dtype=bool), None
    coef, worst = fit(keep)
    if worst > 0.5:
        fits_without = [fit(np.arange(len(x)) != i) for i in range(len(x))]
        i = min(range(len(x)), key=lambda i: fits_without[i][1])
        dropped, (coef, worst) = pts[i], fits_without[i]
    return {"coef": [float(c) for c in coef], "worst": worst, "dropped": dropped,
            "attention_layers": attention_layers}


def step_model(fit: dict, rows: int, context: int) -> float:
    a, b = fit["coef"]
    layers = fit["attention_layers"]
    return a + b * rows + (kv_read_ms(rows, context, layers) if layers else 0.0)


def hidden_host_ms(point: dict, collective_ms: float = 0.0) -> float:
    """A lower bound of the slowest rank's step with its host work hidden behind its GPU work: per
    rank the larger of its host busy and its GPU work left when the host stopped (the drain; the GPU
    work beside the host's is in neither), the step's collective on the GPU's side."""
    return max(max(h, d + collective_ms) for h, d in zip(point["host_ms"], point["drain_ms"]))


def control_lines(base: dict, control: dict, keys: list[str], spread: dict | None = None) -> list[str]:
    """Replicated decode at pcp=N (``pcpN_replicated``) against pcp=1: the slowest rank's turn and host
    busy (medians), which differ from pcp=1's by what taking turns adds (a rank that waits in a
    collective resumes on a host the other ranks ran on) and by one gather of the sampled rows. Where
    the run has spread decode at the same N, its slowest rank's turn beside it and (x) = the control's
    turn / spread's: both steps take turns on the one GPU alike, so this ratio holds no turn-taking
    cost that the one against pcp=1 charges to spread alone."""
    if not control:
        return []
    ns, spread = sorted(control), spread or {}

    def cell(d, key):
        p = d.get(key, {})
        if "turn_ms" not in p:
            return f"{'-':>14}"
        host = f"{max(p['host_ms']):5.2f}" if "host_ms" in p else "    -"
        return f"{max(p['turn_ms']):7.2f} {host} "

    def spread_cell(n, key):
        turn, ctl = spread.get(n, {}).get(key, {}).get("turn_ms"), control[n].get(key, {}).get("turn_ms")
        if not turn or not ctl:
            return f"{'-':>16}"
        return f"{max(turn):7.2f} ({max(ctl) / max(turn):4.2f}x)"

    lines = ["", "control: replicated decode at pcp=N on the same shared GPU (pcp=1's step + one gather of the "
             "sampled rows): the slowest rank's turn and host busy (ms, medians), against pcp=1's"
             + ("; spreadN turn: spread decode's at that N, (x) = pcpN's turn / spreadN's turn" if spread else ""),
             f"{'context':>8} {'B':>3} {'pcp1 turn host':>15} "
             + " ".join(f"{f'pcp{n} turn host':>15}" + (f" {f'spread{n} turn':>16}" if spread else "")
                        for n in ns)]
    for key in keys:
        if not any(key in control[n] for n in ns):
            continue
        context, batch = key.split("/")
        lines.append(f"{context:>8} {batch:>3} {cell(base, key):>15} "
                     + " ".join(f"{cell(control[n], key):>15}" + (f" {spread_cell(n, key)}" if spread else "")
                                for n in ns))
    return lines


PHASE_BATCHES = (1, 8, 64)


def phase_lines(data: dict, keys: list[str]) -> list[str]:
    """The host's time by phase (``host_phases``), ms per step (the mean over the measured steps), the
    largest of the ranks', at the first context and ``PHASE_BATCHES``: one column per config."""
    configs = [c for c in data if any("phases_ms" in data[c].get(k, {}) for k in keys)]
    if not configs:
        return []
    context = min(int(k.split("/")[0]) for k in keys)
    lines = ["", f"host time by phase (ms per step, mean over {STEPS} steps, the largest of the ranks'; inclusive: "
             "a phase holds the phases it calls; host busy: the waits for the GPU, the collectives' copies and the "
             f"waits for the other ranks left out; benchmarks/host_phases.py), {context}-token contexts"]
    for batch in PHASE_BATCHES:
        key = f"{context}/{batch}"
        per = {c: data[c][key]["phases_ms"] for c in configs if "phases_ms" in data[c].get(key, {})}
        if not per:
            continue
        labels = sorted({label for ranks in per.values() for r in ranks for label in r},
                        key=lambda label: -max(r.get(label, 0.0) for ranks in per.values() for r in ranks))
        lines.append(f"{'B=' + str(batch):>6} {'phase':48s} " + " ".join(f"{c:>12}" for c in per))
        for label in labels:
            cells = [max((r.get(label) for r in ranks if label in r), default=None) for ranks in per.values()]
            lines.append(f"{'':6} {label:48s} " + " ".join(f"{v:12.3f}" if v is not None else f"{'-':>12}"
                                                            for v in cells))
    return lines


def runs(out: str) -> dict:
    """{config: its run's JSON} of the runs in ``out``."""
    return {c: json.loads((Path(out) / f"{c}.json").read_text()) for c in CONFIGS if (Path(out) / f"{c}.json").exists()}


def folder_settings(data: dict, out: str, adding: tuple[int, int] | None = None) -> tuple[int, int]:
    """The one (layer count, draft count) of the runs in ``data`` (and of a run ``adding`` to them): the
    report's model terms take one of each; a folder of runs of different settings is refused."""
    settings = {(d.get("layers", DEFAULT_LAYERS), d.get("drafts", 0)) for d in data.values()}
    settings |= {adding} if adding else set()
    if len(settings) > 1:
        raise SystemExit(f"runs of different (layers, drafts) in {out}: {sorted(settings)} (one --out per "
                         "--layers and --mtp)")
    return settings.pop() if settings else (DEFAULT_LAYERS, 0)


def rank_bytes(model: str, drafts: int = 0) -> int:
    """One rank's GPU memory, estimated: the checkpoint's weights (experts, mixers, the embedding
    and LM head; with ``drafts`` the MTP head's layer and input projection), the KV cache of
    ``shared_gpu_args`` and ``RANK_ALLOWANCE_BYTES``."""
    t = json.loads((Path(model) / "config.json").read_text())["text_config"]
    h, layers, period = t["hidden_size"], t["num_hidden_layers"], t["full_attention_interval"]
    ffn = 3 * h * (t["num_experts"] * t["moe_intermediate_size"] + t["shared_expert_intermediate_size"])
    q = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    v = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    gdn = h * (2 * q + 3 * v + 2 * t["linear_num_value_heads"])  # q, k, v, z, b, a in; out
    heads = t["num_attention_heads"] * t["head_dim"]
    attention = h * ((2 if t.get("attn_output_gate") else 1) * heads + 2 * t["num_key_value_heads"] * t["head_dim"]
                     + heads)  # q (and its gate), k, v in; out
    mixers = layers // period * ((period - 1) * gdn + attention)
    mtp = ffn + attention + 2 * h * h if drafts else 0
    # bytes per parameter of the experts and mixers: 1 in the FP8 layout (its narrow layers left out)
    width = 1 if json.loads((Path(model) / "config.json").read_text()).get("quantization_config") else 2
    weights = width * (layers * ffn + mixers + mtp) + 2 * 2 * t["vocab_size"] * h
    return weights + bench_ttft.shared_gpu_args(1)["kv_cache_memory_bytes"] + RANK_ALLOWANCE_BYTES


def check_fits(model: str, configs: list[str], total: int, drafts: int = 0) -> None:
    """Refuses, before any engine starts, configs whose ranks together outgrow the one GPU (``total``
    bytes)."""
    need = rank_bytes(model, drafts)
    over = [c for c in configs if CONFIGS[c] * need > total]
    if over:
        most = max(CONFIGS[c] for c in over)
        raise SystemExit(f"{', '.join(over)}: {most} ranks of about {need / 1e9:.0f} GB each do not fit this GPU's "
                         f"{total / 1e9:.0f} GB; fewer --layers")


def gpu_query(field: str) -> str | None:
    """A field of the engines' GPU (the first visible one) from nvidia-smi (this process leaves CUDA to
    the engines); None without it."""
    import subprocess

    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        value = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", first],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return value or None


def gpu_bytes() -> int | None:
    """The engines' GPU's memory, None without nvidia-smi."""
    mib = gpu_query("memory.total")
    return int(mib.split()[0]) << 20 if mib else None


def gpu_names(data: dict) -> str:
    """The GPU the runs name (``measure``; runs that name none ran on an H200)."""
    return " / ".join(sorted({d.get("gpu", "H200").removeprefix("NVIDIA ") for d in data.values()}))


def tokens_per_step(data: dict) -> str:
    """The range of the points' tokens per request and step (``measure``), as text."""
    values = [p["tokens_per_step"] for d in data.values() for k, p in d.items()
              if "/" in k and p.get("tokens_per_step") is not None]
    return f"{min(values):.2f} to {max(values):.2f}" if values else "unrecorded"


def report(out: str) -> dict:
    """The table (``table.txt``) and plot. Per point, replicated: pcp=1's turn time; spreadN: the slowest
    rank's turn time less its collectives' copies through host memory (``own_ms``; where a run has
    none, the whole turn: an upper bound) plus the step's collective on NVLink. The step-time model:
    ``replicated`` fitted to pcp=1 (x = B), and per N a spread rank's ``overhead`` (x = B) over pcp=1's
    step of its ceil(B/N) requests; a spread step at a context not run is predicted as that pcp=1 step
    (the fit, K/V reads included) plus the overhead plus the collective."""
    data = runs(out)
    layers, drafts = folder_settings(data, out)
    attention = layers // 4
    # each point's plan built once
    collective = functools.lru_cache(maxsize=None)(lambda n, batch, attention: collectives_ms(n, batch, attention,
                                                                                              drafts))
    base, piecewise = data.get("pcp1", {}), data.get("pcp1_piecewise", {})
    spread = {CONFIGS[c]: d for c, d in data.items() if c.endswith("_spread")}
    control = {CONFIGS[c]: d for c, d in data.items() if c.endswith("_replicated")}
    ns = sorted(spread)
    keys = sorted({k for d in data.values() for k in d if "/" in k}, key=lambda k: tuple(map(int, k.split("/"))))
    rows, staged = [], all("own_ms" in d[k] for d in spread.values() for k in d if "/" in k)
    for key in keys:
        context, batch = map(int, key.split("/"))
        row = {"context": context, "batch": batch}
        for name, d in (("replicated_ms", base), ("piecewise_ms", piecewise)):
            if key in d:
                row[name] = d[key]["turn_ms"][0]
        if "host_ms" in base.get(key, {}):
            row["replicated_hidden_ms"] = hidden_host_ms(base[key])
        for n, d in spread.items():
            if key in d:
                turns = d[key]["turn_ms"]
                own = d[key].get("own_ms", turns)  # per rank: turn less copies (a run without them: turn)
                row[f"spread{n}_turn_ms"] = max(turns)
                row[f"spread{n}_ms"] = max(own) + collective(n, batch, attention)
                if "host_ms" in d[key]:
                    row[f"spread{n}_hidden_ms"] = hidden_host_ms(d[key], collective(n, batch, attention))
        for n, d in control.items():
            if key in d:
                row[f"control{n}_turn_ms"] = max(d[key]["turn_ms"])
        rows.append(row)
    pts = [(r["batch"], r["context"], r["replicated_ms"]) for r in rows if "replicated_ms" in r]
    replicated_fit = fit_line(pts, attention) if len(pts) >= 4 else None

    def replicated(batch, context):
        """pcp=1's step of ``batch`` requests: measured, unless absent or the fit's outlier."""
        t = base.get(f"{context}/{batch}", {}).get("turn_ms", [None])[0]
        if replicated_fit is None or (t is not None and replicated_fit["dropped"] != (batch, context, t)):
            return t
        return step_model(replicated_fit, batch, context)

    overhead_fits = {}
    for n in ns:
        pts = [(r["batch"], r["context"], r[f"spread{n}_ms"] - collective(n, r["batch"], attention)
                - replicated(math.ceil(r["batch"] / n), r["context"]))
               for r in rows if f"spread{n}_ms" in r and replicated(math.ceil(r["batch"] / n), r["context"])]
        if len(pts) >= 4:
            overhead_fits[n] = fit_line(pts, None)

    def ms(r, key, width):
        return f"{r[key]:{width}.2f}" if key in r else f"{'-':>{width}}"

    def spread_cells(r, n):
        rep = replicated(r["batch"], r["context"])
        ratio = (f"({rep / r[f'spread{n}_ms']:4.2f}x)" if rep and f"spread{n}_ms" in r else " " * 7)
        return f"{ms(r, f'spread{n}_turn_ms', 8)} {ms(r, f'spread{n}_ms', 9)} {ratio}"

    with_piecewise = any("piecewise_ms" in r for r in rows)
    own_step = ("its turn time less its collective's copies through host memory (measured) + the collective "
                "on NVLink (modelled)" if staged else
                "its turn time + the collective on NVLink (modelled): an upper bound, the turn holding the "
                "collective's copies through host memory (this run did not time them)")
    shared = any(d.get("shared_prefix") for d in data.values())
    lines = [f"Decode step per rank (ms), Qwen3.6-35B-A3B shape, first {layers} layers, dummy weights, "
             f"compiled with CUDA graphs, one {gpu_names(data)}, ranks taking turns"
             + (f"; prefix caching on, each context's requests one shared prompt but their last {TAIL} tokens "
                "(--shared-prefix)" if shared else "")
             + (f"; MTP head drafting {drafts} tokens (--mtp): every step verifies 1 + {drafts} rows per request, "
                f"random drafts ({tokens_per_step(data)} tokens per request and step)" if drafts else ""),
             "replicated: pcp=1's step (measured turn time; every rank of a replicated decode runs it); "
             + ("piecewise: pcp=1 with vLLM's PIECEWISE graphs alone (measured); " if with_piecewise else "")
             + f"spreadN turn: the slowest rank's turn time (measured); spreadN: its step on a GPU of its own = "
             f"{own_step}; (x) = replicated / spreadN"
             + (" (replicated from the fit where the measured point is the outlier it left out)"
                if replicated_fit and replicated_fit["dropped"] else ""),
             f"{'context':>8} {'B':>3} {'replicated':>11} " + (f"{'piecewise':>10} " if with_piecewise else "")
             + " ".join(f"{'spread' + str(n) + ' turn':>13} {'spread' + str(n):>9} {'':7}" for n in ns)]
    for r in rows:
        lines.append(f"{r['context']:>8} {r['batch']:>3} {ms(r, 'replicated_ms', 11)} "
                     + (f"{ms(r, 'piecewise_ms', 10)} " if with_piecewise else "")
                     + " ".join(f"    {spread_cells(r, n)}" for n in ns))
    hidden = [r for r in rows if "replicated_hidden_ms" in r or any(f"spread{n}_hidden_ms" in r for n in ns)]
    if hidden:
        lines += ["", "lower bounds with the host's work hidden behind the GPU's (as vLLM's async scheduling can on "
                  "a GPU of its own): per rank max(host busy, GPU work left when the host stopped (+ the "
                  "collective on NVLink)), from the medians of its turns, the slowest rank's shown; the GPU work "
                  "beside the host's is in neither term, so a step can take longer; a ratio of two bounds "
                  "bounds nothing",
                  f"{'context':>8} {'B':>3} {'replicated':>11} " + " ".join(f"{'spread' + str(n):>9}" for n in ns)]
        for r in hidden:
            lines.append(f"{r['context']:>8} {r['batch']:>3} {ms(r, 'replicated_hidden_ms', 11)} "
                         + " ".join(ms(r, f"spread{n}_hidden_ms", 9) for n in ns))
    fits = {"replicated": replicated_fit, **{f"overhead{n}": f for n, f in overhead_fits.items()}}
    if replicated_fit and overhead_fits:
        lines += ["", "step-time model, fitted to the points above: "
                  + "; ".join(f"{k}: {f['coef'][0]:.2f} ms + {f['coef'][1]:.3f} ms x B"
                              + (" + K/V reads (80% of HBM peak)" if f["attention_layers"] else "")
                              + f", worst fit error {100 * f['worst']:.0f}%"
                              + (f", left out (B, L, ms) ({f['dropped'][0]}, {f['dropped'][1]}, "
                                 f"{f['dropped'][2]:.2f})" if f["dropped"] else "")
                              for k, f in fits.items()),
                  f"predicted per rank ({layers} layers, ms): replicated = pcp=1's step of B requests; spreadN = "
                  "pcp=1's step of ceil(B/N) requests + overheadN(B) + the collective on NVLink"
                  + ("" if staged else " (an upper bound, as above)") + "; (x) = replicated / spreadN",
                  f"{'context':>8} {'B':>3} {'replicated':>11} " + " ".join(f"{'spread' + str(n):>16}"
                                                                           for n in overhead_fits)]
        for context in PREDICT_CONTEXTS:
            for batch in PREDICT_BATCHES:
                rep = step_model(replicated_fit, batch, context)
                cells = []
                for n, overhead in overhead_fits.items():
                    spr = (step_model(replicated_fit, math.ceil(batch / n), context)
                           + step_model(overhead, batch, context) + collective(n, batch, attention))
                    cells.append(f"{spr:8.2f} ({rep / spr:4.2f}x)")
                lines.append(f"{context:>8} {batch:>3} {rep:11.2f} " + " ".join(cells))
    profiles = {c: d["profile"] for c, d in data.items() if d.get("profile")}
    for config, ranks in profiles.items():
        lines.append(f"profile of {config}, {PROFILE_POINT[1]} requests of {PROFILE_POINT[0]} tokens, "
                     "per step (ms):")
        for label, p in ranks.items():
            ops = ", ".join(f"{k} {v:.2f}" for k, v in p["host_ops_ms"].items())
            lines.append(f"  {label}: GPU busy {p['gpu_busy_ms']:.2f} of span {p['gpu_span_ms']:.2f}; "
                         f"host: {ops}")
    for config, d in data.items():
        for rank, funcs in enumerate(d.get("host_profile") or []):
            top = list(funcs.items())[:HOST_PROFILE_TOP]
            lines.append(f"host Python of {config} rank{rank} under cProfile, cumulative ms per step: "
                         + ", ".join(f"{k} {v:.2f}" for k, v in top))
    lines += control_lines(base, control, keys, spread)
    lines += phase_lines(data, keys)
    kinds = {c: d.get("step_kinds") for c, d in data.items() if d.get("step_kinds")}
    if kinds:
        lines.append("model forwards by kind, per rank (whole: unsplit; owned_<graph mode>: a spread decode "
                     "step, the rank's own requests as vLLM's batch; split: other planned steps): "
                     + "; ".join(f"{c}: {k}" for c, k in kinds.items()))
    plan_ms = base.get("plan_ms", {})
    if plan_ms:
        lines.append("host plan of a batch's first spread step (ms, measured, inside the turn times; its later steps "
                     "reuse it): "
                     + ", ".join(f"pcp{k.split('/')[0]} B={k.split('/')[1]}: {v:.2f}" for k, v in plan_ms.items()))
    table = "\n".join(lines)
    print(table)
    (Path(out) / "table.txt").write_text(table + "\n")

    def draw(ax):
        for context, style in zip(sorted({r["context"] for r in rows}), ("-", "--", ":")):
            pts = [r for r in rows if r["context"] == context]
            for key, name, color in (("replicated_ms", "replicated", "C0"), ("piecewise_ms", "pcp=1 PIECEWISE", "C7"),
                                     *((f"spread{n}_ms", f"spread pcp={n}", f"C{i + 1}") for i, n in enumerate(ns))):
                have = [r for r in pts if key in r]
                if have:
                    ax.plot([r["batch"] for r in have], [r[key] for r in have], style, color=color, marker="o",
                            label=f"{name}, {context // 1024}k context")
            for i, n in enumerate(ns):  # both taking turns alike (``control_lines``), faint, in their kind's colour
                for key, name, marker, color in ((f"control{n}_turn_ms", f"replicated pcp={n} turn", "s", "C0"),
                                                 (f"spread{n}_turn_ms", f"spread pcp={n} turn", "^", f"C{i + 1}")):
                    have = [r for r in pts if key in r and f"control{n}_turn_ms" in r]
                    if have:
                        ax.plot([r["batch"] for r in have], [r[key] for r in have], style, color=color, alpha=0.45,
                                marker=marker, label=f"{name}, {context // 1024}k context")
        dropped = replicated_fit["dropped"] if replicated_fit else None
        if dropped:
            ax.annotate("outlier (left out of the fit)", (dropped[0], dropped[2]), textcoords="offset points",
                        xytext=(8, -4), fontsize=8)
        log2_axes(ax, "requests decoding (B)", "decode step per rank (ms)",
                  f"Decode step per rank, {layers} layers (measured" + (")" if staged else "; spread: upper bound)"))

    save_figure(str(Path(out) / "decode_spread.png"), draw, fontsize=6.5, loc="upper left", ncol=2)
    return {"rows": rows, "fits": fits}


def child(config: str, model: str, out: str, sweep: dict, profile: bool = False, shared_prefix: bool = False,
          layers: int = DEFAULT_LAYERS, drafts: int = 0) -> None:
    from harness.shared_gpu import STEPS_ENV, read_step_kinds

    steps = Path(out) / f"{config}.steps"
    for old in steps.parent.glob(steps.name + ".*"):
        old.unlink()
    os.environ[STEPS_ENV] = str(steps)  # each rank records the kind of each step
    path = str(Path(out) / f"{config}.json")
    trace_dir = str(Path(out) / f"{config}_traces") if profile else None
    measure(model, config, sweep, path, trace_dir, shared_prefix, layers, drafts)
    data = json.loads(Path(path).read_text())
    if trace_dir:
        data["profile"] = summarize_profile(trace_dir)
    data["step_kinds"] = read_step_kinds(steps)
    Path(path).write_text(json.dumps(data))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/decode_spread")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(DEFAULT_CONFIGS))
    parser.add_argument("--contexts", type=int, nargs="+", choices=list(SWEEP), default=list(DEFAULT_CONTEXTS),
                        help="past 16384 tokens with --shared-prefix (else the contexts outgrow the KV cache)")
    parser.add_argument("--shared-prefix", action="store_true",
                        help=f"each context's requests share all but their last {TAIL} prompt tokens (prefix "
                             "caching on; see measure)")
    parser.add_argument("--batches", type=int, nargs="+", help="only these batch sizes of the sweep")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, choices=range(4, 41, 4),
                        help="the model's first layers (whole periods of 3 GDN + 1 attention); at pcp=N every "
                             "rank's weights share the one GPU (about 1.7 GB per layer and rank): configs that "
                             "clearly do not fit are refused before any engine starts (rank_bytes)")
    parser.add_argument("--mtp", action="store_true",
                        help=f"every config with the MTP head drafting {MTP_DRAFTS} tokens (see above)")
    parser.add_argument("--fp8", action="store_true",
                        help="the block-wise FP8 checkpoint layout (dummy weights): 40 layers at pcp=2 fit one H200")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also profile a few decode steps (see above)")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    sweep = {c: tuple(b for b in SWEEP[c] if not args.batches or b in args.batches) for c in args.contexts}
    if args.profile and PROFILE_POINT[1] not in sweep.get(PROFILE_POINT[0], ()):
        parser.error(f"--profile profiles the point L={PROFILE_POINT[0]}, B={PROFILE_POINT[1]}: keep that context")
    if args.mtp and args.shared_prefix:
        parser.error("--mtp with --shared-prefix: spread decode with MTP is refused with prefix caching")
    if args.child:
        child(*args.child, args.out, sweep, args.profile, args.shared_prefix, args.layers,
              MTP_DRAFTS if args.mtp else 0)
        return
    if not args.report_only:
        folder_settings({c: d for c, d in runs(args.out).items() if c not in args.configs}, args.out,
                        (args.layers, MTP_DRAFTS if args.mtp else 0))
        model = bench_ttft.checkpoint(args.out, layers=args.layers, fp8=args.fp8)
        if (total := gpu_bytes()) is not None:
            check_fits(model, args.configs, total, MTP_DRAFTS if args.mtp else 0)
        for config in args.configs:
            # a run that fails before its first point leaves no earlier run's numbers in its place
            (Path(args.out) / f"{config}.json").unlink(missing_ok=True)
            argv = [__file__, "--out", args.out, "--layers", str(args.layers), "--contexts", *map(str, args.contexts),
                    *(["--batches", *map(str, args.batches)] if args.batches else []),
                    *(["--profile"] if args.profile else []), *(["--shared-prefix"] if args.shared_prefix else []),
                    *(["--mtp"] if args.mtp else []),
                    "--child", config, model]
            bench_ttft.run_child(argv, str(Path(args.out) / f"{config}.log"), "race_free", in_process=True,
                                 turns_lock=str(Path(args.out) / "turns.lock"))
    report(args.out)


if __name__ == "__main__":
    main()
