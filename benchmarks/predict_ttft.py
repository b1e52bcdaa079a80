# SPDX-License-Identifier: Apache-2.0
"""Time to first token at pcp=N on H200s, predicted from one-GPU profiles and the plan's collectives.

    python benchmarks/predict_ttft.py                     # tables, a PNG, and the validation error
    python benchmarks/predict_ttft.py --profile --out DIR # remake the profiles on one GPU (profile_prefill.py)

The model of one prefill step of T new tokens (Qwen3.6-35B-A3B shape, eager, bf16):

- **GPU time by kernel kind**, from vLLM's torch profiler on one H200 at pcp=1, 32k and 128k tokens
  (``profile_prefill_pcp1_h200_2026-12-01``). Attention is fitted as a T + b T^2 (causal), every other
  kind as a T + c. tp=2: every kind halves except "other" (norms, residual adds and routing run on
  every row of every TP rank).
- **A PCP rank's share**, measured: ``profile_prefill.py --shared-gpu --layers 8`` ran pcp=1 and pcp=2
  (relay; state passing) on one H200, every rank's kernels alone on the GPU in turn, at 32k and 128k
  (``profile_prefill_split_1xh200_2026-12-02``: the model's first 8 layers, whole experts). Per kind,
  a rank's kernel time over pcp=1's (about 0.5; more where the split step copies and indexes), and
  ``imbalance``: the step's critical path (the slowest rank between two collectives) over what the
  per-kind shares give (with the relay's chain below) at N = 2; both interpolated in log T and held
  at the ends. Other N: each kind's share scales by 2/N, except the relay's state recurrence (fla's
  ``chunk_..._fwd_kernel_h``, 19% of GDN time at pcp=1 at both lengths), which runs rank after rank
  over the whole prompt; ``imbalance`` is kept. Beyond N = 2 this is modelled, not measured, and
  leaves out what grows with N: state passing's fold over the runs of blocks, and the per-step
  work in "other" that does not divide (the shares are applied to a 40-layer profile whose fixed
  per-step part is 8/40 of the profiled model's). Sharded experts: 1/N of pcp=1's MoE time (not
  profiled split: their collectives through host memory make the shared-GPU engine too slow there).
- **Collectives**: the calls a split step's layers issue through ``PCPContext``, from the step's plan
  (``step_traffic``, checked call for call against what the layers issue on gloo ranks by
  ``test_step_traffic.py``): per attention layer the new K/V all-gather; per GDN layer the conv-halo
  all-gather, the replicated requests' states from rank 0 and, relay, each run's end state sent to
  the next run's owner (2N-2 hand-offs in series) and the final states broadcast by the last owner,
  or, state passing, one all-gather of the summaries; the final all-gather of the rows vLLM samples
  from. vLLM's own: with sharded experts an all-gather and a reduce-scatter of the hidden rows per MoE
  layer; at tp=2 two all-reduces per layer. Time = latency + bytes each GPU receives / bandwidth: a
  ring all-gather or broadcast receives (N-1)/N x N and 1 x its payload; its latency is NCCL's ring LL
  base latency plus a step per further rank, a send/recv's NCCL's point-to-point latency (constants
  and sources below).
- **The host's floor**: a step never takes less than the host takes to launch its kernels, pcp=1's
  measured eager steps of 256 to 4096 tokens (``SHORT_STEPS``: about 160 ms, the same from 256 to
  8192 tokens), and a rank of a split step launches as many kernels as an unsplit one.
- **Host time**: TTFT - GPU busy time at pcp=1 (measured). Of it, the first token's detokenization
  from the whole prompt (``bench_detokenizer.py``, measured at 32k, 128k and 1M tokens) is once per
  request, and at pcp > 1 the prompt's tail replaces it (under a millisecond, left out); the rest,
  fitted as a T + c, is per step and the same at pcp=N.

Across nodes of 8 H200s (TP inside a node, PCP across: the last table, docs/multi-node.md) TP's
all-reduces stay on NVLink and PCP's collectives cross InfiniBand (constants below).

**Steps of a running server** (``ServingStepModel``, for ``benchmarks/serve_sim.py``): vLLM serves compiled
(torch.compile, CUDA graphs), and a step mixes prompt chunks, decode rows and MTP verification rows (1 + K
rows per request):

- **A step with prompt chunks**: the eager model's GPU time above times ``compiled_scale`` plus
  ``compiled_step_s`` per step, both fitted (least squares) to pcp=1's compiled TTFT in one step and in
  chunks of 8192 and 16384 tokens (``COMPILED``, one H200). At pcp=N a chunk of at least the split
  threshold (``min_split_tokens``, 4096) is split as ``step`` splits one; the other chunks and every decode
  and verification row run whole on every rank (replicated), priced as pcp=1's rows; the per-kind constants
  count once per step. A step of at most ``GRAPH_TOKENS`` tokens replays vLLM's CUDA graphs: no
  ``compiled_step_s``.
- **Decode and verification rows** (``decode_s``): a roofline, ``decode_fixed_s`` + max(the bytes a step
  reads from HBM at 80% of peak, its rows at the prompt's per-token compute): every dense weight and the
  LM head once, the routed experts the step's rows touch (1 - (1 - 8/256)^rows of them), each request's
  K/V in the attention layers, its GDN states read once and written once per verified row (fp32), and
  with MTP the drafter's K passes (one attention and one MoE layer and the LM head each).
  ``decode_fixed_s`` (host, launch, sampling) is fitted so that one request after 1024 tokens takes
  pcp=1's measured compiled inter-token latency (``COMPILED``, 40 layers); ``mtp_fixed_s`` (the rejection
  sampler and the drafts' host work) = the measured step with MTP (K = 3) less without, less what the
  roofline adds for them, fitted a + b B (``DECODE_MTP``: 8 layers, one H100). Decode at pcp=N is pcp=1's
  (replicated) plus one gather of the sampled rows (and of the drafts). At tp=t every weight, GDN state and
  K/V head (at most 2) divides over t, plus two all-reduces per layer.
- **The MTP drafter's first pass over prompt rows**: a q + b (query, key) pairs through the measured
  drafter at 32k and 128k (``MTP_DRAFTER``, pcp=1, eager), times ``compiled_scale``; over a split chunk's
  rows each rank runs its own (``mtp_first_pass="split"``): 1/N of it.
- **Layers**: with the first L layers of the model (``layers``), every per-layer term scales by L/40,
  ``decode_fixed_s`` and the drafter do not. **GPUs**: the prefill fits are H200's (an H100 has the same
  compute: taken as is); HBM bandwidth and memory are the card's (``GPUS``).

It validates against the TTFT measured on 2 x H200 on 2026-11-29 that it was not fitted to (pcp=2 with
state passing and sharded experts; tp=2) and prints each error. A chunked prefill with a token budget B
runs ceil(T/B) steps; step i attends B queries to i*B + B keys.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo: benchmarks/
from benchmarks import step_traffic  # noqa: E402
from benchmarks.plot import log2_axes, save_figure  # noqa: E402
from qwen36_pcp.config import PCPConfig  # noqa: E402
from qwen36_pcp.plan import PCPPlan  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PROFILES = RESULTS / "profile_prefill_pcp1_h200_2026-12-01"
SPLIT_PROFILES = RESULTS / "profile_prefill_split_1xh200_2026-12-02"
SPLIT_SHARES = SPLIT_PROFILES / "shares.json"  # per length: what the model reads of each profile row
SHARE_FIELDS = ("kinds_ms", "critical_ms", "critical_paired")
TTFT_2X = RESULTS / "ttft_2xh200_2026-11-29" / "bench_ttft.json"
DETOKENIZER = RESULTS / "output_rows_1xh200_2026-12-02" / "bench_detokenizer.json"
SHORT_STEPS = RESULTS / "short_steps_1xh200_2026-12-02" / "bench_ttft.json"  # pcp=1, 256 to 32k tokens
COMPILED = RESULTS / "chunk_budget_1xh200_2026-12-02" / "bench_ttft.json"  # pcp=1 compiled: chunks, ITL
DECODE_MTP = RESULTS / "decode_spread_mtp_1xh100_2026-12-06"  # pcp1.json (K = 3), without_mtp/pcp1.json
MTP_DRAFTER = RESULTS / "mtp_drafter_1xh200_2026-12-03"  # pcp1.json, pcp1_mtp.json: prefill with the drafter

# NVLink 4 on H200 SXM: 900 GB/s per GPU, both directions together (NVIDIA H200 datasheet), so 450 GB/s
# each way; NCCL reaches about 80% of it on large messages (assumed).
NVLINK_BYTES_PER_S = 0.8 * 450e9
# Latency of a small collective over NVLink, from NCCL's own cost model (src/graph/tuning.cc, quoted in
# github.com/NVIDIA/nccl/issues/1334): ring with the LL protocol, 6.6 us base + 0.6 us per NVLink step,
# N-1 steps for an all-gather or a broadcast among N ranks (a measured ring all-reduce of 8 bytes, 2(N-1)
# steps, took 10 us on 2 and 33.7 us on 8 A100s: github.com/NVIDIA/nccl-tests/issues/123). A send/recv
# pair: 3 us (nccl-tests on two H100s over NVLink, github.com/NVIDIA/nccl/issues/1487).
RING_BASE_LATENCY_S, NVLINK_STEP_LATENCY_S = 6.6e-6, 0.6e-6
P2P_LATENCY_S = 3e-6


def collective_latency_s(n: int) -> float:
    return RING_BASE_LATENCY_S + (n - 1) * NVLINK_STEP_LATENCY_S


COLLECTIVE_LATENCY_S = collective_latency_s(2)  # what bench_output_rows prices a pcp=2 gather with
# Between nodes (PCP across H200 HGX nodes, one ConnectX-7 NDR NIC per GPU): 400 Gb/s = 50 GB/s each
# way per GPU (NVIDIA ConnectX-7 datasheet), 80% of it reached (assumed, as for NVLink); latency per
# collective: assumed 30 us (NCCL's small-message all-gather over InfiniBand is tens of us).
IB_BYTES_PER_S = 0.8 * 50e9
IB_LATENCY_S = 30e-6

# Qwen3.6-35B-A3B
LAYERS, ATTN_LAYERS, GDN_LAYERS, MOE_LAYERS = 40, 10, 30, 40
HIDDEN, KV_HEADS, HEAD_DIM = 2048, 2, 256
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_DIM, CONV_KERNEL = 16, 32, 128, 4
BF16, FP32 = 2, 4
ATTN_HEADS, VOCAB = 16, 248320
EXPERTS, TOP_K, EXPERT_DIM, SHARED_EXPERT_DIM = 256, 8, 512, 512
RELAY_SERIAL_SHARE = 0.19  # chunk_gated_delta_rule_fwd_kernel_h / all GDN kernels, pcp=1 (both lengths)

LENGTHS = (32768, 131072, 1048576)
GDN_MODE_LENGTHS = (8192, 32768, 131072, 524288, 1048576)
BUDGETS = {"one step": None, "budget 8192 (vllm serve)": 8192, "budget 16384 (LLM)": 16384}
SPLIT_CONFIGS = {"relay": "pcp2", "state_passing": "pcp2_state_passing"}  # in SPLIT_PROFILES


class Config(NamedTuple):
    pcp: int
    tp: int
    gdn: str | None  # "relay" | "state_passing" (pcp > 1)
    experts: str | None  # "whole" | "sharded" (pcp > 1)
    # the code measured on 2026-11-29 did both (now: the rows vLLM samples from; the prompt's tail)
    gather_every_row: bool = False  # a split step all-gathers every hidden row
    detokenize_whole_prompt: bool = False  # the first token's detokenization, as vLLM (always at pcp=1)


CONFIGS = {
    "pcp1": Config(1, 1, None, None), "tp2": Config(1, 2, None, None),
    "pcp2": Config(2, 1, "relay", "whole"), "pcp2_state_passing": Config(2, 1, "state_passing", "whole"),
    "pcp2_sp_sharded": Config(2, 1, "state_passing", "sharded", gather_every_row=True,
                              detokenize_whole_prompt=True),
    "pcp4": Config(4, 1, "relay", "whole"), "pcp4_state_passing": Config(4, 1, "state_passing", "whole"),
    "pcp8": Config(8, 1, "relay", "whole"), "pcp8_state_passing": Config(8, 1, "state_passing", "whole"),
}
# model config: measured config (pcp=1's TTFT is what the host time is fitted to: not a validation)
VALIDATION = {"pcp2_sp_sharded": "pcp2_state_passing", "tp2": "tp2"}
TARGETS = {("pcp2", 32768): 1.7, ("pcp2", 131072): 1.85, ("pcp4", 131072): 3.4}
# nodes of 8 H200s, TP inside a node, PCP across nodes (docs/multi-node.md): name -> (config, nodes)
MULTI_NODE = {
    "1 node, tp8": (Config(1, 8, None, None), 1),
    "2 nodes, tp8 x pcp2, relay": (Config(2, 8, "relay", "whole"), 2),
    "2 nodes, tp8 x pcp2, state passing": (Config(2, 8, "state_passing", "whole"), 2),
    "4 nodes, tp8 x pcp4, relay": (Config(4, 8, "relay", "whole"), 4),
    "4 nodes, tp8 x pcp4, state passing": (Config(4, 8, "state_passing", "whole"), 4),
}
MULTI_NODE_LENGTHS = (131072, 1048576)


def load(path: Path):
    return json.loads(path.read_text())


def splits(q: int, n: int) -> bool:
    """Whether a step of q new tokens (one request) is split at pcp=n with the default options."""
    return PCPConfig().step_splits([q], n)


@functools.lru_cache(maxsize=4096)
def split_plan(q: int, cached: int, n: int) -> PCPPlan:
    """The plan of a step of q new tokens of one request after ``cached`` (the defaults' zigzag)."""
    return PCPPlan([cached], [q], n, 0, PCPConfig(min_split_tokens=1))


def layer_shape(tp: int) -> step_traffic.LayerShape:
    """Qwen3.6-35B-A3B's layers per TP rank (vLLM replicates the 2 KV heads beyond tp = 2)."""
    return step_traffic.LayerShape(
        kv_heads=max(1, KV_HEADS // tp), head_dim=HEAD_DIM, gdn_k_heads=GDN_K_HEADS // tp,
        gdn_v_heads=GDN_V_HEADS // tp, gdn_head_k=GDN_HEAD_DIM, gdn_head_v=GDN_HEAD_DIM,
        conv_width=CONV_KERNEL, hidden=HIDDEN)


class StepModel:
    """Per-kind GPU time fits at pcp=1 and a pcp=2 rank's measured shares; ``step(q, cached, config)``
    in s."""

    def __init__(self):
        prof = {n: load(PROFILES / d / "profile_prefill.json")["pcp1/rank0"] for n, d in
                ((32768, "32k"), (131072, "128k"))}
        ttft = load(TTFT_2X)
        (t1, p1), (t2, p2) = sorted(prof.items())
        self.kinds = {}
        for kind in ("attention", "gdn", "moe", "gemm", "other"):
            y1, y2 = p1["kinds_ms"][kind] / 1e3, p2["kinds_ms"][kind] / 1e3
            if kind == "attention":  # a T + b T^2 through both points
                b = (y2 / t2 - y1 / t1) / (t2 - t1)
                self.kinds[kind] = (y1 / t1 - b * t1, b, 0.0)
            else:  # a T + c
                a = (y2 - y1) / (t2 - t1)
                self.kinds[kind] = (a, 0.0, y1 - a * t1)
        # the first token's detokenization from the whole prompt (measured per length, once per
        # request); the rest of the host time per step: a T + c
        rows = load(DETOKENIZER)["rows"]
        self.detokenize = [(0, 0.0)] + [(r["tokens"], r["whole_prompt_s"]) for r in rows]
        host = {t: ttft["pcp1"][str(t)] - p["busy_ms"] / 1e3 - self.whole_prompt_detokenize_s(t)
                for t, p in prof.items()}
        a = (host[t2] - host[t1]) / (t2 - t1)
        self.host = (a, host[t1] - a * t1)
        # a step is never shorter than the host takes to launch its kernels: pcp=1's measured steps of
        # 256 to 4096 tokens (less the first token's detokenization) lie within 10% of their median
        short = {int(t): v - self.whole_prompt_detokenize_s(int(t))
                 for t, v in load(SHORT_STEPS)["pcp1"].items() if t.isdigit()}
        self.floor = statistics.median(v for t, v in short.items() if t <= 4096)
        # pcp=2 per rank relative to pcp=1, per kind, mode and length: the split profiles (8 layers,
        # whole experts, each rank's kernels alone on one H200, pcp=1 in the same run)
        self.split = {mode: {} for mode in SPLIT_CONFIGS}
        for n, d in ((32768, "32k"), (131072, "128k")):
            rows = load(SPLIT_SHARES)[d]
            base = rows["pcp1/rank0"]["kinds_ms"]
            for mode, config in SPLIT_CONFIGS.items():
                ranks = [r for name, r in rows.items() if name.startswith(config + "/")]
                assert ranks[0]["critical_paired"], f"{config} at {d}: the ranks' collectives did not pair up"
                factors = {k: sum(r["kinds_ms"][k] for r in ranks) / len(ranks) / base[k] for k in base
                           if k != "communication"}
                modelled = sum(base[k] * self._critical_share(k, factors, mode, 2) for k in factors)
                factors["imbalance"] = ranks[0]["critical_ms"] / modelled
                self.split[mode][n] = factors

    @staticmethod
    def _critical_share(kind: str, factors: dict, mode: str, n: int) -> float:
        """Time at pcp=n / pcp=1 of one kind on the critical path, from its pcp=2 factor: every kind's
        work divides by n, but the relay's state recurrence (RELAY_SERIAL_SHARE of GDN at pcp=1) runs
        rank after rank: each rank's kernels hold 1/n of it, the step waits for all of it."""
        f2 = factors[kind]
        if kind == "gdn" and mode == "relay":
            return (f2 - RELAY_SERIAL_SHARE / 2) * 2 / n + RELAY_SERIAL_SHARE
        return f2 * 2 / n

    def factors(self, mode: str, tokens: int) -> dict:
        """The pcp=2 factors at ``tokens``, interpolated in log T between the profiled lengths."""
        pts = self.split[mode]
        t1, t2 = sorted(pts)
        w = (min(max(math.log(tokens), math.log(t1)), math.log(t2)) - math.log(t1)) / math.log(t2 / t1)
        return {k: pts[t1][k] + (pts[t2][k] - pts[t1][k]) * w for k in pts[t1]}

    def kind_s(self, kind: str, rows: float, causal_pairs: float | None = None) -> float:
        """pcp=1 GPU time of one kind for ``rows`` query rows; attention by its causal (query, key)
        pairs (rows^2/2 for a fresh prompt)."""
        a, b, c = self.kinds[kind]
        if kind == "attention":
            return a * rows + b * 2 * (causal_pairs if causal_pairs is not None else rows * rows / 2)
        return a * rows + c

    @staticmethod
    def collectives(cfg: Config, q: int, cached: int = 0, split: bool | None = None) -> list[tuple[str, int, int, int]]:
        """(name, calls, bytes each GPU receives per call, latency kind) of one step of q new tokens
        after ``cached`` (one request); latency kind: the ranks in a ring collective, or 0 for a
        send/recv (one hand-off of the relay's chain, which the step waits for in turn). ``split``:
        whether the step splits (default: as the default options decide)."""
        n, tp, mode, experts, every_row, _ = cfg
        out = []
        if tp > 1:  # over each rank's q/n rows; a ring all-reduce receives 2(tp-1)/tp of its input
            out.append(("tp all-reduce", 2 * LAYERS, int(2 * (tp - 1) / tp * q / n * HIDDEN * BF16), tp))
        if experts == "sharded":  # every step, split or not
            out.append(("MoE all-gather + reduce-scatter", 2 * MOE_LAYERS, int((n - 1) / n * q * HIDDEN * BF16), n))
        if not (splits(q, n) if split is None else split and n > 1):
            return out
        plan, shape = split_plan(q, cached, n), layer_shape(tp)

        def priced(name, count, calls):
            for kind, nbytes, _ in calls:
                if kind in ("all_gather", "broadcast"):  # group-wide, the same on every rank
                    out.append((f"{name} {kind}", count, nbytes * (n - 1 if kind == "all_gather" else 1), n))

        priced("attention K/V", ATTN_LAYERS, step_traffic.attention(plan, shape))
        priced("GDN", GDN_LAYERS, step_traffic.gdn(plan, shape, mode, 0))
        if mode == "relay":  # every rank's sends, one after another along the chain
            sends = [c for r in range(n) for c in step_traffic.gdn(plan, shape, mode, r) if c[0] == "send"]
            out.append(("GDN relay hand-off (serial)", GDN_LAYERS * len(sends), sends[0][1], 0))
        if every_row:  # the earlier code: every hidden row after a split step
            out.append(("final hidden-row all-gather", 1, (n - 1) * plan.t_pad * HIDDEN * BF16, n))
        else:
            priced("final sampled-row", 1, step_traffic.output(plan, shape, all_rows=False))
        return out

    def step(self, cfg: Config, q: int, cached: int, nodes: int = 1, split: bool | None = None) -> dict:
        """Seconds of one step: q new tokens after ``cached`` tokens of the same request; with
        ``nodes`` > 1 the PCP collectives cross the network (TP's stay inside a node)."""
        n, tp, mode, experts, _, _ = cfg
        pairs = q * cached + q * q / 2
        gpu = {"attention": self.kind_s("attention", q, pairs), "gdn": self.kind_s("gdn", q),
               "moe": self.kind_s("moe", q), "gemm": self.kind_s("gemm", q), "other": self.kind_s("other", q)}
        split = splits(q, n) if split is None else split and n > 1
        if split:
            f = self.factors(mode, q)
            gpu = {k: v * self._critical_share(k, f, mode, n) * f["imbalance"] for k, v in gpu.items()}
        if n > 1 and experts == "sharded":  # 1/N of the experts on every row (not profiled split)
            gpu["moe"] = self.kind_s("moe", q) / n
        if tp > 1:
            gpu = {k: v / tp if k != "other" else v for k, v in gpu.items()}
        def seconds(name, count, nbytes, ranks):
            if nodes > 1 and name != "tp all-reduce":
                return count * (IB_LATENCY_S + nbytes / IB_BYTES_PER_S)
            latency = P2P_LATENCY_S if ranks == 0 else collective_latency_s(ranks)
            return count * (latency + nbytes / NVLINK_BYTES_PER_S)

        comm = sum(seconds(*c) for c in self.collectives(cfg, q, cached, split))
        a, c = self.host
        host = a * q + c
        # a rank of a split step launches as many kernels as an unsplit step: the same floor
        return {**gpu, "communication": comm, "host": host,
                "total": max(self.floor, sum(gpu.values()) + comm + host)}

    def whole_prompt_detokenize_s(self, tokens: int) -> float:
        """vLLM's first-token detokenization of a prompt: the measurements, linear between them and
        beyond the last."""
        pts = self.detokenize
        i = next((k for k in range(1, len(pts)) if tokens <= pts[k][0]), len(pts) - 1)
        (t0, s0), (t1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)

    def detokenize_s(self, cfg: Config, tokens: int) -> float:
        """The first token's detokenization: vLLM's from the whole prompt (pcp=1, the earlier code),
        else the prompt tail's (measured: well under a millisecond, left out)."""
        whole = cfg.pcp == 1 or cfg.detokenize_whole_prompt
        return self.whole_prompt_detokenize_s(tokens) if whole else 0.0

    def ttft(self, cfg: Config, tokens: int, budget: int | None = None, nodes: int = 1) -> float:
        budget = budget or tokens
        total, done = self.detokenize_s(cfg, tokens), 0
        while done < tokens:
            q = min(budget, tokens - done)
            total += self.step(cfg, q, done, nodes)["total"]
            done += q
        return total


class Gpu(NamedTuple):
    name: str
    memory_bytes: int  # the card's total, as nvidia-smi reports it
    hbm_bytes_per_s: float  # peak HBM bandwidth (NVIDIA's datasheets)


GPUS = {"h200": Gpu("H200", 143771 * 2**20, 4.8e12), "h100": Gpu("H100", 81559 * 2**20, 3.35e12)}
HBM_EFFICIENCY = 0.8  # of peak, as bench_decode_spread prices K/V reads
GRAPH_TOKENS = 512  # vLLM 0.20.2's largest CUDA graph by default: steps of up to this many tokens replay one
ITL_CONTEXT = 1024 + 64  # bench_ttft's ITL: 128 tokens decoded after a 1024-token prompt (mean context)


class Rows(NamedTuple):
    """One request's rows in a step: ``new`` tokens after ``cached``; ``prompt``: a prompt chunk (or a
    recompute after preemption), else one decode row (``drafts`` = 0) or 1 + ``drafts`` verification rows."""

    new: int
    cached: int
    prompt: bool
    drafts: int = 0


def weight_bytes(tp: int = 1, layers: int = LAYERS) -> dict:
    """bf16 bytes of Qwen3.6-35B-A3B's language-model weights on one GPU, by part, at tp (experts whole over
    PCP, split over TP; MTP: its layer and fc, which share the LM head)."""
    gdn = (HIDDEN * 2 * (GDN_K_HEADS + GDN_V_HEADS) * GDN_HEAD_DIM + HIDDEN * 2 * GDN_V_HEADS
           + GDN_V_HEADS * GDN_HEAD_DIM * HIDDEN)  # in_proj_qkvz, in_proj_ba, out_proj
    attn = HIDDEN * (2 * ATTN_HEADS + 2 * KV_HEADS) * HEAD_DIM + ATTN_HEADS * HEAD_DIM * HIDDEN  # q + gate, k, v, o
    moe_dense = HIDDEN * EXPERTS + 3 * HIDDEN * SHARED_EXPERT_DIM + HIDDEN  # router, shared expert, its gate
    experts = EXPERTS * 3 * HIDDEN * EXPERT_DIM
    la = layers // (LAYERS // ATTN_LAYERS)
    return {k: v * BF16 / tp for k, v in {
        "dense": (layers - la) * gdn + la * attn + layers * moe_dense, "experts": layers * experts,
        "lm_head": VOCAB * HIDDEN, "embedding": VOCAB * HIDDEN,
        "mtp_dense": attn + moe_dense + 2 * HIDDEN * HIDDEN, "mtp_experts": experts}.items()}


def kv_bytes_per_token(tp: int = 1) -> int:
    """One attention layer's K and V per token on one GPU (2 KV heads; beyond tp = 2 vLLM replicates them)."""
    return 2 * max(1, KV_HEADS // tp) * HEAD_DIM * BF16


def gdn_state_bytes(tp: int = 1) -> int:
    """One GDN layer's recurrent state (fp32, ``mamba_ssm_dtype``) and conv window of one request on one GPU."""
    conv = (2 * GDN_K_HEADS + GDN_V_HEADS) * GDN_HEAD_DIM * (CONV_KERNEL - 1) * BF16
    return (GDN_V_HEADS * GDN_HEAD_DIM * GDN_HEAD_DIM * FP32 + conv) // tp


class ServingStepModel(StepModel):
    """Steps of a running server (compiled): prompt chunks, decode and verification rows in any mix, at
    any batch; ``batch_step(config, rows, mtp)`` in s. See the module's docstring."""

    def __init__(self, gpu: str = "h200", layers: int = LAYERS):
        super().__init__()
        self.gpu, self.layers, self.scale = GPUS[gpu], layers, layers / LAYERS
        compiled = load(COMPILED)["pcp1"]
        design, measured = [], []
        for key, seconds in compiled.items():
            if not key[0].isdigit():
                continue
            tokens, _, budget = key.partition("@")
            tokens, budget = int(tokens), int(budget or tokens)
            steps = [(min(budget, tokens - done), done) for done in range(0, tokens, budget)]
            design.append([sum(sum(self._kinds(q, c).values()) for q, c in steps), len(steps)])
            measured.append(seconds - self.whole_prompt_detokenize_s(tokens))
        self.compiled_scale, self.compiled_step_s = map(float, numpy_lstsq(design, measured)[0])
        slopes = sum(self.kinds[k][0] for k in ("gdn", "moe", "gemm", "other"))
        self.row_s = self.compiled_scale * slopes  # a row's compute at pcp=1, 40 layers (prompt efficiency)
        # pcp=1's compiled ITL, one request after 1024 tokens (40 layers, H200): what the roofline leaves
        self.decode_fixed_s = compiled["itl_ms"] / 1e3 - self._roofline(
            1, 1, ITL_CONTEXT, 0, 0, 1, LAYERS, GPUS["h200"])
        # MTP (K = 3): the measured step with MTP less without (8 layers, one H100), less the roofline's part
        with_mtp, without = (load(DECODE_MTP / d / "pcp1.json") for d in (".", "without_mtp"))
        k, layers8, h100 = with_mtp["drafts"], with_mtp["layers"], GPUS["h100"]
        pts = []
        for key in sorted(set(with_mtp) & set(without), key=str):
            if "/" not in key:
                continue
            ctx, b = map(int, key.split("/"))
            extra = (with_mtp[key]["turn_ms"][0] - without[key]["turn_ms"][0]) / 1e3
            extra -= (self._roofline((1 + k) * b, b, b * ctx, k, k, 1, layers8, h100)
                      - self._roofline(b, b, b * ctx, 0, 0, 1, layers8, h100))
            pts.append((b, extra))
        self.mtp_fixed = tuple(map(float, numpy_lstsq([[1, b] for b, _ in pts], [e for _, e in pts])[0]))
        # the drafter's first pass over a prompt: a q + b pairs through the measured drafter (pcp=1, eager)
        drafter = {}
        no, mtp = (load(MTP_DRAFTER / f) for f in ("pcp1.json", "pcp1_mtp.json"))
        for t in (32768, 131072):
            drafter[t] = (lookup_ms(mtp, t) - lookup_ms(no, t)) / 1e3
        (t1, y1), (t2, y2) = sorted(drafter.items())
        b = (y2 / t2 - y1 / t1) / (t2 / 2 - t1 / 2)  # y = a q + b q^2 / 2 through both points
        self.drafter = (y1 / t1 - b * t1 / 2, b)

    def _kinds(self, q: int, cached: int, constants: bool = True) -> dict:
        """pcp=1's eager GPU time by kind of q prompt rows after ``cached`` (40 layers)."""
        out = {k: self.kind_s(k, q, q * cached + q * q / 2) if k == "attention" else self.kind_s(k, q)
               for k in ("attention", "gdn", "moe", "gemm", "other")}
        if not constants:
            out = {k: v - self.kinds[k][2] for k, v in out.items()}
        return out

    def drafter_s(self, q: int, cached: int) -> float:
        """The MTP drafter's first pass over q prompt rows after ``cached``, eager (one attention and one MoE
        layer: independent of the target's layers)."""
        a, b = self.drafter
        return a * q + b * (q * cached + q * q / 2)

    def mtp_fixed_s(self, requests: int) -> float:
        a, b = self.mtp_fixed
        return max(0.0, a + b * requests)

    def _roofline(self, rows, reqs, context, drafts, mtp, tp, layers, gpu, bytes_only=False) -> float:
        """max(HBM bytes / bandwidth, rows x compute) of a step of ``rows`` decode/verification rows of
        ``reqs`` requests reading ``context`` K/V tokens in all, without the fixed part (``bytes_only``:
        the first alone)."""
        w = weight_bytes(tp, layers)
        la = layers // (LAYERS // ATTN_LAYERS)

        def touched(n):  # the share of experts n rows route to
            return 1 - (1 - TOP_K / EXPERTS) ** n

        nbytes = (w["dense"] + w["lm_head"] + w["experts"] * touched(rows) + la * context * kv_bytes_per_token(tp)
                  + (layers - la) * reqs * gdn_state_bytes(tp) * (2 + drafts))
        for p in range(mtp):  # the drafter's passes: first over every row, then one row per request
            n = rows if p == 0 else reqs
            nbytes += (w["mtp_dense"] + w["lm_head"] + w["mtp_experts"] * touched(n)
                       + context * kv_bytes_per_token(tp))
        memory = nbytes / (HBM_EFFICIENCY * gpu.hbm_bytes_per_s)
        return memory if bytes_only else max(memory, rows * self.row_s * layers / LAYERS / tp)

    def _tp_s(self, tp: int, rows: int) -> float:
        """TP's two all-reduces per layer over ``rows`` rows of each rank."""
        if tp == 1:
            return 0.0
        latency = RING_BASE_LATENCY_S + 2 * (tp - 1) * NVLINK_STEP_LATENCY_S
        return 2 * self.layers * (latency + 2 * (tp - 1) / tp * rows * HIDDEN * BF16 / NVLINK_BYTES_PER_S)

    def decode_s(self, cfg: Config, rows: int, reqs: int, context: int, drafts: int = 0, mtp: int = 0,
                 bytes_only: bool = False) -> float:
        """A step of decode (``drafts`` = 0) or verification rows alone, replicated at pcp > 1 (``bytes_only``:
        its HBM reads without the rows' compute, the floor of any step)."""
        t = self.decode_fixed_s + self._roofline(rows, reqs, context, drafts, mtp, cfg.tp, self.layers, self.gpu,
                                                 bytes_only)
        t += self._tp_s(cfg.tp, rows) + (self.mtp_fixed_s(reqs) if mtp else 0.0)
        if cfg.pcp > 1:  # rank 0's sampled rows gathered (and its drafts broadcast)
            t += (1 + (mtp > 0)) * collective_latency_s(cfg.pcp) + reqs * HIDDEN * BF16 / NVLINK_BYTES_PER_S
        return t

    def batch_step(self, cfg: Config, rows: list[Rows], mtp: int = 0) -> dict:
        """Seconds of one step of ``rows`` (one entry per scheduled request) with the MTP drafter's ``mtp``
        passes: ``total``, ``split`` (a prompt chunk split over the PCP ranks) and the parts."""
        assert cfg.experts != "sharded", "the serving model prices whole experts (the default)"
        n, tp, mode = cfg.pcp, cfg.tp, cfg.gdn
        reqs, tokens = len(rows), sum(r.new for r in rows)
        decoding = [r for r in rows if not r.prompt]
        drafts = max((r.drafts for r in decoding), default=0)
        context = sum(r.cached for r in rows)
        prompts = [r for r in rows if r.prompt]
        if not prompts:
            total = self.decode_s(cfg, tokens, reqs, context, drafts, mtp)
            return {"total": total, "split": False, "memory": total}
        memory = self.decode_s(cfg, tokens, reqs, context, drafts, mtp, bytes_only=True)  # at least its reads
        split = [r for r in prompts if n > 1 and splits(r.new, n)]
        whole = [r for r in prompts if not (n > 1 and splits(r.new, n))]
        gpu = dict.fromkeys(("attention", "gdn", "moe", "gemm", "other"), 0.0)
        comm, drafter, first = 0.0, 0.0, True
        for r in split:  # as ``step`` splits one: each kind's critical share, the imbalance, the collectives
            f = self.factors(mode, r.new)
            for k, v in self._kinds(r.new, r.cached, constants=first).items():
                gpu[k] += v * self._critical_share(k, f, mode, n) * f["imbalance"]
            first = False
            comm += sum(c * ((P2P_LATENCY_S if ranks == 0 else collective_latency_s(ranks))
                             + nbytes / NVLINK_BYTES_PER_S)
                        for name, c, nbytes, ranks in self.collectives(cfg, r.new, r.cached, True)
                        if name != "tp all-reduce")
            drafter += self.drafter_s(r.new, r.cached) / n
        for r in whole:  # replicated: pcp=1's rows on every rank
            for k, v in self._kinds(r.new, r.cached, constants=first).items():
                gpu[k] += v
            first = False
            drafter += self.drafter_s(r.new, r.cached)
        dec_rows = sum(r.new for r in decoding)
        for k in ("gdn", "moe", "gemm", "other"):  # decode/verification rows: replicated, their compute
            gpu[k] += self.kinds[k][0] * dec_rows
        gpu = {k: v * self.scale / (1 if k == "other" else tp) for k, v in gpu.items()}
        per_rank = sum(r.new for r in split) / n + sum(r.new for r in whole) + dec_rows
        dec_ctx = sum(r.cached for r in decoding)
        la = self.layers // (LAYERS // ATTN_LAYERS)
        dec_bytes = (la * dec_ctx * kv_bytes_per_token(tp)  # their K/V and GDN states from HBM
                     + (self.layers - la) * len(decoding) * gdn_state_bytes(tp) * (2 + drafts))
        extra = dec_bytes / (HBM_EFFICIENCY * self.gpu.hbm_bytes_per_s) + self._tp_s(tp, per_rank)
        if mtp:
            extra += self.drafter_s(dec_rows, dec_ctx // max(1, len(decoding))) + self.mtp_fixed_s(len(decoding))
        if n > 1 and not split:
            extra += collective_latency_s(n) + reqs * HIDDEN * BF16 / NVLINK_BYTES_PER_S
        compute = self.compiled_scale * (sum(gpu.values()) + drafter * (mtp > 0)) + comm + extra
        if tokens > GRAPH_TOKENS:  # no CUDA graph: the compiled step's own per-step time
            compute += self.compiled_step_s * self.scale
        return {"total": max(memory, compute), "split": bool(split), "memory": memory, "compute": compute,
                "communication": comm, **gpu}


def numpy_lstsq(design, values):
    import numpy as np

    return np.linalg.lstsq(np.asarray(design, dtype=float), np.asarray(values, dtype=float), rcond=None)


def lookup_ms(data: dict, tokens: int) -> float:
    """A prefill step's ms at ``tokens`` from a bench_mtp result (the slowest rank's turn)."""
    return max(data[f"prefill/{tokens}"]["turn_ms"])


def validate(model: StepModel) -> float:
    measured = load(TTFT_2X)
    worst = 0.0
    print("validation against 2 x H200 (2026-11-29), one step, eager")
    print(f"{'config':>22} {'tokens':>7} {'measured s':>11} {'predicted s':>12} {'error':>7}")
    for name, key in VALIDATION.items():
        for t, m in sorted(measured[key].items(), key=lambda kv: int(kv[0])):
            p = model.ttft(CONFIGS[name], int(t))
            err = (p - m) / m
            worst = max(worst, abs(err))
            print(f"{name:>22} {t:>7} {m:>11.3f} {p:>12.3f} {err:>+7.1%}")
    return worst


def tables(model: StepModel) -> dict:
    rows = {}
    for label, budget in BUDGETS.items():
        print(f"\npredicted TTFT (s), {label}; (x) = speedup over pcp1")
        print(f"{'config':>20} " + " ".join(f"{t // 1024:>12}k" for t in LENGTHS))
        base = {t: model.ttft(CONFIGS["pcp1"], t, budget) for t in LENGTHS}
        for name, cfg in CONFIGS.items():
            vals = {t: model.ttft(cfg, t, budget) for t in LENGTHS}
            rows[(label, name)] = vals
            print(f"{name:>20} " + " ".join(f"{vals[t]:>7.2f} ({base[t] / vals[t]:.2f}x)" for t in LENGTHS))
    print("\nPCP's own speedup, one step: over pcp1 with the prompt tail's detokenization too")
    print(f"{'config':>20} " + " ".join(f"{t // 1024:>6}k" for t in LENGTHS))
    for name, cfg in CONFIGS.items():
        same = [(rows[("one step", "pcp1")][t] - model.detokenize_s(CONFIGS["pcp1"], t)
                 + model.detokenize_s(cfg, t)) / rows[("one step", name)][t] for t in LENGTHS]
        print(f"{name:>20} " + " ".join(f"{x:>6.2f}x" for x in same))
    print("\ntargets (one step); in brackets: against pcp1 with the prompt tail's detokenization too")
    for (name, t), target in TARGETS.items():
        pcp1, this = rows[("one step", "pcp1")][t], rows[("one step", name)][t]
        same = (pcp1 - model.detokenize_s(CONFIGS["pcp1"], t)) / this
        print(f"  {name} at {t // 1024}k: predicted {pcp1 / this:.2f}x ({same:.2f}x), target {target}x")
    return rows


def multi_node(model: StepModel) -> None:
    """PCP across nodes of 8 H200s (TP inside a node), one step and vLLM's serve budget x pcp."""
    print("\npredicted TTFT (s) across nodes of 8 x H200 (NVLink inside, InfiniBand NDR between);"
          " (x, y) = speedup over one node at tp=8, as vLLM is / with the prompt tail's detokenization too")
    one_node = MULTI_NODE["1 node, tp8"][0]
    for label, scale in (("one step", None), ("budget 8192 x pcp", 8192)):
        print(f"{label}:\n{'config':>36} " + " ".join(f"{t // 1024:>19}k" for t in MULTI_NODE_LENGTHS))
        base = {t: model.ttft(one_node, t, scale) for t in MULTI_NODE_LENGTHS}
        for name, (cfg, nodes) in MULTI_NODE.items():
            budget = scale and scale * cfg.pcp
            vals = {t: model.ttft(cfg, t, budget, nodes) for t in MULTI_NODE_LENGTHS}
            same = {t: (base[t] - model.detokenize_s(one_node, t) + model.detokenize_s(cfg, t)) / vals[t]
                    for t in MULTI_NODE_LENGTHS}
            print(f"{name:>36} " + " ".join(f"{vals[t]:>7.2f} ({base[t] / vals[t]:.2f}x, {same[t]:.2f}x)"
                                            for t in MULTI_NODE_LENGTHS))


def faster_gdn_mode(model: StepModel, error: float) -> None:
    """Which GDN mode the model predicts faster, per N and length (one step). The relay keeps pcp=1's
    bits, so a default per N leaves it only where state passing is faster by more than the model's
    validation error (which holds for N = 2; beyond, the model leaves out state passing's fold)."""
    print(f"\nfaster GDN mode (one step), predicted: relay / state passing TTFT; a default leaves the relay "
          f"where state passing is faster by more than {error:.1%}")
    for n in (2, 4, 8):
        cells, beyond = [], []
        for t in GDN_MODE_LENGTHS:
            relay, sp = (model.ttft(CONFIGS[f"pcp{n}{suffix}"], t) for suffix in ("", "_state_passing"))
            cells.append(f"{t // 1024}k: {'relay' if relay <= sp else 'state passing'} ({relay / sp:.2f})")
            beyond.append(relay / sp - 1 > error)
        default = "state passing" if all(beyond) else "relay"
        print(f"  pcp{n}: " + ", ".join(cells) + f" -> default {default}")


def break_even(model: StepModel, n: int, cached: int = 0) -> int | None:
    """The fewest new tokens (multiples of 256 from the split floor up to 32k) whose step a split at
    pcp=n makes faster than the unsplit step, after ``cached`` tokens of the same request; None: none.

    Below about 8k new tokens an eager step of this model takes as long as the host takes to launch
    its kernels (the floor: pcp=1's measured steps of 256 to 4096 tokens, ``SHORT_STEPS``), and a rank
    of a split step launches as many: a split only adds its collectives until the GPU's work of the
    unsplit step exceeds the floor. The split path's own extra host work is not in the model, so the
    real break-even lies at or above this one.
    """
    cfg = CONFIGS.get(f"pcp{n}", Config(n, 1, "relay", "whole"))
    floor = PCPConfig(min_split_tokens=1).split_threshold(n)
    for tokens in range(-(-floor // 256) * 256, 32768 + 1, 256):
        split = model.step(cfg, tokens, cached, split=True)["total"]
        if split < model.step(CONFIGS["pcp1"], tokens, cached)["total"]:
            return tokens
    return None


def short_prompts(model: StepModel) -> dict:
    print(f"\nshort steps: the fewest new tokens a split step makes faster (predicted; the floor: pcp=1's "
          f"measured eager steps of 256 to 4096 tokens, {model.floor * 1e3:.0f} ms)")
    out = {}
    for n in range(2, 9):
        out[n] = {c: break_even(model, n, c) for c in (0, 32768, 131072)}
        print(f"  pcp{n}: fresh prompt {out[n][0]}, a chunk after 32k cached {out[n][32768]}, after 128k "
              f"{out[n][131072]} (min_split_tokens {PCPConfig().split_threshold(n)})")
    return out


def breakdown(model: StepModel, tokens: int = 131072) -> None:
    print(f"\none step of {tokens // 1024}k tokens, per rank (ms):")
    kinds = ("attention", "gdn", "moe", "gemm", "other", "communication", "host", "detokenize", "total")
    print(f"{'config':>20} " + " ".join(f"{k[:10]:>10}" for k in kinds))
    for name in ("pcp1", "tp2", "pcp2", "pcp2_state_passing", "pcp2_sp_sharded", "pcp4", "pcp8"):
        s = model.step(CONFIGS[name], tokens, 0)
        s["detokenize"] = model.detokenize_s(CONFIGS[name], tokens)
        s["total"] += s["detokenize"]
        print(f"{name:>20} " + " ".join(f"{s[k] * 1e3:>10.1f}" for k in kinds))


def plot(model: StepModel, path: str) -> None:
    lengths = [2 ** k for k in range(13, 21)]

    def draw(ax):
        for name in ("tp2", "pcp2", "pcp2_state_passing", "pcp4", "pcp8"):
            ax.plot(lengths, [model.ttft(CONFIGS["pcp1"], t) / model.ttft(CONFIGS[name], t) for t in lengths],
                    marker="o", label=name)
        log2_axes(ax, "prompt tokens (one step)", "predicted TTFT speedup over pcp=1",
                  "Qwen3.6-35B-A3B shape, H200 + NVLink (model)")
    save_figure(path, draw)


def main():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/predict_ttft")
    parser.add_argument("--profile", action="store_true",
                        help="remake the profiles at 32k and 128k on this machine's GPU into --out: pcp=1 "
                             "(40 layers) and, every rank on GPU 0, pcp=1 and pcp=2 split (8 layers)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        script = [sys.executable, str(REPO / "benchmarks" / "profile_prefill.py")]
        for tokens, name in ((32768, "32k"), (131072, "128k")):
            subprocess.run([*script, "--out", str(out / "pcp1" / name), "--tokens", str(tokens),
                            "--configs", "pcp1"], check=True)
            subprocess.run([*script, "--out", str(out / "split" / name), "--tokens", str(tokens),
                            "--configs", "pcp1", *SPLIT_CONFIGS.values(), "--shared-gpu", "--layers", "8"],
                           check=True)
        shares = {name: {row: {k: r[k] for k in SHARE_FIELDS} for row, r in
                         load(out / "split" / name / "profile_prefill.json").items()} for name in ("32k", "128k")}
        (out / "split" / SPLIT_SHARES.name).write_text(json.dumps(shares, indent=1) + "\n")
        print(f"profiles in {out}/pcp1 and {out}/split; copy them to {PROFILES} and "
              f"{out}/split/{SPLIT_SHARES.name} to {SPLIT_SHARES}")
        return
    model = StepModel()
    worst = validate(model)
    tables(model)
    faster_gdn_mode(model, worst)
    breakdown(model)
    short_prompts(model)
    multi_node(model)
    plot(model, str(out / "predict_ttft.png"))
    print(f"\nmax validation error: {worst:.1%}")


if __name__ == "__main__":
    main()
