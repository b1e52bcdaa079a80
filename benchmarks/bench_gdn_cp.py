"""GDN layer time per rank: state passing vs island vs one GPU, Qwen3.6-35B-A3B GDN shape, 2 GPUs.

    python benchmarks/bench_gdn_cp.py --out results/   # needs 2 GPUs; prints a table, writes JSON + PNG

Layer time = input projections (in_proj_qkvz, in_proj_ba) + GDN core (conv, gates, scan, and for PCP its
communication and correction) + out_proj, on the tokens each rank computes. Kernels are vLLM 0.20.2's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from qwen36_pcp.tools.plot import save_figure

HIDDEN = 2048
TOKENS = (32768, 131072)


def _time(fn, group, reps=5):
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _worker(rank, group, tokens):
    from qwen36_pcp.layers.context import PCPContext
    from qwen36_pcp.layers.gdn_cp import VllmGDNKernels, gdn_full_reference, gdn_island, gdn_state_passing
    from qwen36_pcp.plan import PCPConfig, PCPPlan
    from qwen36_pcp.tools.layer_inputs import GDN, gdn_inputs

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
        idx = plan.device_tensors(dev).local_idx
        t_loc = plan.t_pad

        def layer(n_tok, core):
            h = x[:n_tok] @ w_in.T  # projections on the tokens this rank owns
            out = torch.zeros(n_tok, hv, dv, device=dev, dtype=torch.bfloat16)
            core(out)
            return out.view(n_tok, -1) @ w_out.T, h

        def one_gpu():
            conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
            layer(T, lambda o: gdn_full_reference(VllmGDNKernels, inp["mixed_qkv"], inp["b"], inp["a"], o, w,
                                                  conv, ssm, inp["state_idx"][:1], [0], cu_cpu))

        local = [inp[k][idx] for k in ("mixed_qkv", "b", "a")]
        sent = {}

        def pcp(mode):
            ctx = PCPContext(plan, group, dev)
            conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
            if mode == "state_passing":
                core = lambda o: gdn_state_passing(ctx, VllmGDNKernels, *local, o, w, conv, ssm,  # noqa: E731
                                                   inp["state_idx"][:1])
            else:
                core = lambda o: gdn_island(  # noqa: E731
                    ctx, lambda q_, b_, a_, o_: gdn_full_reference(
                        VllmGDNKernels, q_, b_, a_, o_, w, conv, ssm, inp["state_idx"][:1], [0], cu_cpu),
                    *local, o)
            layer(t_loc, core)
            sent[mode] = ctx.bytes_sent

        t_one = _time(one_gpu, group)  # every rank runs it: _time synchronises with barriers
        t_sp = _time(lambda: pcp("state_passing"), group)
        t_is = _time(lambda: pcp("island"), group)
        rows.append(dict(tokens=T, one_gpu_ms=t_one, state_passing_ms=t_sp, island_ms=t_is,
                         state_passing_bytes=sent["state_passing"], island_bytes=sent["island"]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    from qwen36_pcp.tools.dist import run_distributed

    per_rank = run_distributed(_worker, 2, args.tokens, backend="nccl")
    os.makedirs(args.out, exist_ok=True)
    table = []
    for i, T in enumerate(args.tokens):
        r = [pr[i] for pr in per_rank]
        one = r[0]["one_gpu_ms"]
        sp = max(x["state_passing_ms"] for x in r)
        isl = max(x["island_ms"] for x in r)
        mib = max(x["state_passing_bytes"] for x in r) / 2**20
        table.append(dict(tokens=T, one_gpu_ms=one, pcp2_state_passing_ms=sp, pcp2_island_ms=isl,
                          state_passing_vs_one_gpu=sp / one, island_vs_one_gpu=isl / one,
                          state_passing_MiB_sent_per_rank=mib,
                          island_MiB_sent_per_rank=max(x["island_bytes"] for x in r) / 2**20))
    hdr = ("tokens", "1 GPU ms", "pcp2 SP ms", "pcp2 island ms", "SP/1GPU", "island/1GPU", "SP MiB/rank", "island MiB/rank")
    print("GDN layer (Qwen3.6-35B-A3B shape: 16 QK / 32 V heads x 128), time per rank, slowest rank")
    print(" | ".join(f"{h:>14}" for h in hdr))
    for t in table:
        print(" | ".join(f"{v:>14.3f}" if isinstance(v, float) else f"{v:>14}" for v in (
            t["tokens"], t["one_gpu_ms"], t["pcp2_state_passing_ms"], t["pcp2_island_ms"],
            t["state_passing_vs_one_gpu"], t["island_vs_one_gpu"], t["state_passing_MiB_sent_per_rank"],
            t["island_MiB_sent_per_rank"])))
    with open(os.path.join(args.out, "bench_gdn_cp.json"), "w") as f:
        json.dump(table, f, indent=1)
    def draw(ax):
        series = (("one_gpu_ms", "1 GPU"), ("pcp2_state_passing_ms", "pcp=2 state passing"),
                  ("pcp2_island_ms", "pcp=2 island"))
        for i, (key, label) in enumerate(series):
            ax.bar([x + 0.27 * i for x in range(len(table))], [t[key] for t in table], width=0.27,
                   label=label)
        ax.set_xticks([x + 0.27 for x in range(len(table))], [f"{t['tokens'] // 1024}k" for t in table])
        ax.set_ylabel("GDN layer time per rank (ms)")

    save_figure(os.path.join(args.out, "bench_gdn_cp.png"), draw)


if __name__ == "__main__":
    main()
