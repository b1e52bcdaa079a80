# SPDX-License-Identifier: Apache-2.0
"""GDN layer time per rank: relay vs state passing vs island vs one GPU, Qwen3.6-35B-A3B GDN shape, 2 GPUs.

    python benchmarks/bench_gdn_cp.py --out /tmp/bench_gdn_cp   # needs 2 GPUs; prints a table, writes JSON + PNG

Layer time = input projections (in_proj_qkvz, in_proj_ba) + GDN core (conv, gates, scan, and for PCP its
communication and correction) + out_proj, on the tokens each rank computes. Kernels are vLLM 0.20.2's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: benchmarks/, harness/
from benchmarks.plot import save_figure  # noqa: E402
from benchmarks.timing import cuda_median_ms  # noqa: E402

HIDDEN = 2048
TOKENS = (32768, 131072)
MODES = ("relay", "state_passing", "island")


def _time(fn, group, reps=5):
    import torch.distributed as dist

    return cuda_median_ms(fn, reps, before_each=dist.barrier)


def _worker(rank, group, tokens):
    from harness.gdn_unsplit import gdn_unsplit_core
    from harness.layer_inputs import GDN, gdn_inputs
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.layers.gdn_cp import gdn_island, gdn_relay, gdn_state_passing
    from qwen36_pcp.layers.gdn_kernels import VllmGDNKernels
    from qwen36_pcp.plan import PCPConfig, PCPPlan

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    hv, dv, dk = GDN["hv"], GDN["dv"], GDN["dk"]
    qkvz_out = 2 * GDN["hk"] * dk + 2 * hv * dv
    w_in = torch.randn(qkvz_out + 2 * hv, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w_out = torch.randn(HIDDEN, hv * dv, device=dev, dtype=torch.bfloat16) * 0.02
    rows = []
    for T in tokens:
        inp, w = gdn_inputs([0], [T], dev)
        x = torch.randn(T, HIDDEN, device=dev, dtype=torch.bfloat16)
        cu_cpu = torch.tensor([0, T], dtype=torch.int32)
        plan = PCPPlan([0], [T], group.world_size, rank, PCPConfig())
        idx = PCPContext(plan, group, dev).t.local_idx
        t_loc = plan.t_pad

        def layer(n_tok, core):
            h = x[:n_tok] @ w_in.T  # projections on the tokens this rank owns
            out = torch.zeros(n_tok, hv, dv, device=dev, dtype=torch.bfloat16)
            core(out)
            return out.view(n_tok, -1) @ w_out.T, h

        def one_gpu():
            conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
            layer(T, lambda o: gdn_unsplit_core(VllmGDNKernels, inp["mixed_qkv"], inp["b"], inp["a"], o, w,
                                                  conv, ssm, inp["state_idx"][:1], [0], cu_cpu))

        local = [inp[k][idx] for k in ("mixed_qkv", "b", "a")]
        sent = {}

        def pcp(mode):
            ctx = PCPContext(plan, group, dev)
            conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
            if mode != "island":
                fn = gdn_relay if mode == "relay" else gdn_state_passing
                core = lambda o: fn(ctx, VllmGDNKernels, *local, o, w, conv, ssm,  # noqa: E731
                                    inp["state_idx"][:1])
            else:
                core = lambda o: gdn_island(  # noqa: E731
                    ctx, lambda q_, b_, a_, o_: gdn_unsplit_core(
                        VllmGDNKernels, q_, b_, a_, o_, w, conv, ssm, inp["state_idx"][:1], [0], cu_cpu),
                    *local, o)
            layer(t_loc, core)
            sent[mode] = ctx.bytes_sent

        row = dict(tokens=T, one_gpu_ms=_time(one_gpu, group))  # every rank: _time syncs with barriers
        for mode in MODES:
            row[f"{mode}_ms"] = _time(lambda: pcp(mode), group)
            row[f"{mode}_bytes"] = sent[mode]
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="/tmp/qwen36_pcp_bench/bench_gdn_cp")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    from harness.dist import run_distributed

    per_rank = run_distributed(_worker, 2, args.tokens, backend="nccl")
    os.makedirs(args.out, exist_ok=True)
    table = []
    for i, T in enumerate(args.tokens):
        r = [pr[i] for pr in per_rank]
        row = dict(tokens=T, one_gpu_ms=r[0]["one_gpu_ms"])
        for mode in MODES:  # the slowest rank's time, the larger rank's bytes
            row[f"pcp2_{mode}_ms"] = max(x[f"{mode}_ms"] for x in r)
            row[f"{mode}_vs_one_gpu"] = row[f"pcp2_{mode}_ms"] / row["one_gpu_ms"]
            row[f"{mode}_MiB_sent_per_rank"] = max(x[f"{mode}_bytes"] for x in r) / 2**20
        table.append(row)
    print("GDN layer (Qwen3.6-35B-A3B shape: 16 QK / 32 V heads x 128), time per rank, slowest rank")
    cols = ["tokens", "one_gpu_ms"] + [f"pcp2_{m}_ms" for m in MODES] + [f"{m}_vs_one_gpu" for m in MODES] \
        + [f"{m}_MiB_sent_per_rank" for m in MODES]
    print(" | ".join(f"{c:>14.14}" for c in cols))
    for t in table:
        print(" | ".join(f"{t[c]:>14.3f}" if isinstance(t[c], float) else f"{t[c]:>14}" for c in cols))
    with open(os.path.join(args.out, "bench_gdn_cp.json"), "w") as f:
        json.dump(table, f, indent=1)
    def draw(ax):
        series = [("one_gpu_ms", "1 GPU")] + [(f"pcp2_{m}_ms", f"pcp=2 {m}") for m in MODES]
        width = 0.8 / len(series)
        for i, (key, label) in enumerate(series):
            ax.bar([x + width * i for x in range(len(table))], [t[key] for t in table], width=width,
                   label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(table))],
                      [f"{t['tokens'] // 1024}k" for t in table])
        ax.set_ylabel("GDN layer time per rank (ms)")

    save_figure(os.path.join(args.out, "bench_gdn_cp.png"), draw)


if __name__ == "__main__":
    main()
