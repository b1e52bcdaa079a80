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
