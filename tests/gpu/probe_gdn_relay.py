"""What would an exact GDN relay cost at pcp=2? Stage times of vLLM's chunked GDN scan (1 GPU).

    python -m tests.gpu.probe_gdn_relay [--tokens 32768 131072] [--out DIR]

A relay passes each block's true end state to the next block's rank, so every rank's scan starts from
its true initial state and reproduces the one-GPU result bit for bit (block bounds on 64-token
chunks), but the scan is serial along the zigzag chain (rank 0: block 0, rank 1: blocks 1-2, rank 0:
block 3). Measured at the Qwen3.6-35B-A3B GDN shape (16 QK / 32 V heads x 128), per layer:

- ``one_gpu``: the whole scan of T tokens;
- ``augmented_half``: today's state passing, one augmented (V + K wide) scan of T/2 per rank;
- ``relay_serial``: the three runs' whole scans one after the other (T/4, T/2, T/4);
- ``relay_prep_parallel``: each rank's chunk-local steps (cumsum, kkt, solve_tril, w/u) for its T/2
  at once, then only the state recurrence (h) and outputs (o) of the runs in chain order: the
  critical path is prep(T/2) + h(T/4) + h(T/2) + h(T/4) + o(T/4);
and checks that the relay's outputs and final state equal the one-GPU scan bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def inputs(T, dev, H=16, HV=32, K=128, V=128, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev, generator=g), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev, generator=g), dim=-1).bfloat16()
    v = torch.randn(T, HV, V, device=dev, generator=g).bfloat16()
    gate = -torch.rand(T, HV, device=dev, generator=g) * 0.1
    beta = torch.rand(T, HV, device=dev, generator=g)
    return q, k, v, gate, beta


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main():
    from vllm.model_executor.layers.fla.ops import chunk_gated_delta_rule
    from vllm.model_executor.layers.fla.ops.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from vllm.model_executor.layers.fla.ops.chunk_o import chunk_fwd_o
    from vllm.model_executor.layers.fla.ops.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from vllm.model_executor.layers.fla.ops.cumsum import chunk_local_cumsum
    from vllm.model_executor.layers.fla.ops.index import prepare_chunk_indices, prepare_chunk_offsets
    from vllm.model_executor.layers.fla.ops.solve_tril import solve_tril
    from vllm.model_executor.layers.fla.ops.wy_fast import recompute_w_u_fwd

    from qwen36_pcp.runner_hooks import race_free_gdn_kkt

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = p.parse_args()
    race_free_gdn_kkt()
    dev = "cuda"
    report = {}
    for T in args.tokens:
        q, k, v, gate, beta = inputs(T, dev)
        HV, V, K = v.shape[1], v.shape[2], k.shape[2]

        def meta(lo, hi):
            cu_cpu = torch.tensor([0, hi - lo], dtype=torch.int32)
            return (cu_cpu.to(dev), prepare_chunk_indices(cu_cpu, 64).to(dev),
                    prepare_chunk_offsets(cu_cpu, 64).to(dev))

        def scan(lo, hi, init, vv=None):
            cu, ci, co = meta(lo, hi)
            vv = v[lo:hi] if vv is None else vv
            return chunk_gated_delta_rule(q=q[None, lo:hi], k=k[None, lo:hi], v=vv[None], g=gate[None, lo:hi],
                                          beta=beta[None, lo:hi], initial_state=init, output_final_state=True,
                                          cu_seqlens=cu, chunk_indices=ci, chunk_offsets=co)

        zero = torch.zeros(1, HV, V, K, device=dev)
        runs = [(0, T // 4), (T // 4, 3 * T // 4), (3 * T // 4, T)]  # zigzag pcp=2 chain, 64-aligned

        def relay():
            state, outs = zero, []
            for lo, hi in runs:
                o, state = scan(lo, hi, state)
                outs.append(o[0])
            return torch.cat(outs), state

        o_ref, s_ref = scan(0, T, zero)
        o_rel, s_rel = relay()
        exact = {"output_max_abs": (o_rel.float() - o_ref[0].float()).abs().max().item(),
                 "state_max_abs": (s_rel - s_ref).abs().max().item()}

        # prep of one rank's T/2 tokens (rank 1: blocks 1-2), then h and o per run
        def prep(lo, hi):
            cu, ci, _ = meta(lo, hi)
            gc = chunk_local_cumsum(gate[None, lo:hi], chunk_size=64, cu_seqlens=cu, chunk_indices=ci)
            A = chunk_scaled_dot_kkt_fwd(k=k[None, lo:hi], beta=beta[None, lo:hi], g=gc, cu_seqlens=cu,
                                         chunk_indices=ci, output_dtype=torch.float32)
            A = solve_tril(A=A, cu_seqlens=cu, chunk_indices=ci, output_dtype=k.dtype)
            w, u = recompute_w_u_fwd(k=k[None, lo:hi], v=v[None, lo:hi], beta=beta[None, lo:hi], A=A,
                                     g_cumsum=gc, cu_seqlens=cu, chunk_indices=ci)
            return gc, w, u

        preps = {r: prep(*r) for r in runs}

        def h_o(r, init, with_o=True):
            lo, hi = r
            cu, ci, co = meta(lo, hi)
            gc, w, u = preps[r]
            h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k[None, lo:hi], w=w, u=u, g=gc, initial_state=init,
                                                           output_final_state=True, cu_seqlens=cu,
                                                           chunk_indices=ci, chunk_offsets=co)
            if with_o:
                chunk_fwd_o(q=q[None, lo:hi], k=k[None, lo:hi], v=v_new, h=h, g=gc, scale=K**-0.5,
                            cu_seqlens=cu, chunk_indices=ci)
            return final

        v_aug = torch.cat([v[: T // 2], v.new_zeros(T // 2, HV, K)], -1)
        init_aug = torch.zeros(1, HV, V + K, K, device=dev)
        t = {
            "one_gpu": timed(lambda: scan(0, T, zero)),
            "augmented_half": timed(lambda: scan(0, T // 2, init_aug, v_aug)),
            "relay_serial": timed(relay),
            "prep_half": timed(lambda: prep(T // 4, 3 * T // 4)),
            "h_all_runs": timed(lambda: [h_o(r, zero, with_o=False) for r in runs]),
            "o_quarter": timed(lambda: h_o(runs[2], zero)) - timed(lambda: h_o(runs[2], zero, with_o=False)),
        }
        t["relay_prep_parallel"] = t["prep_half"] + t["h_all_runs"] + t["o_quarter"]
        report[T] = {"ms": {n: round(x, 3) for n, x in t.items()}, "relay_exact": exact}
        print(T, json.dumps(report[T]), flush=True)
    with open(os.path.join(args.out, "probe_gdn_relay.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
