"""How far are GDN state passing and the relay (pcp=2) from exact, next to vLLM's own one-GPU
kernels? (1 GPU)

    python -m tests.gpu.probe_gdn_precision [--out DIR]

All are compared with an fp32 reference scan (``TorchGDNKernels``) of the same bf16 inputs, at the
Qwen3.6-35B-A3B GDN shape, with gates that keep a long memory (the tiny checkpoint's dt_bias law),
so the state carried into the second rank's block matters. The two ranks of ``gdn_state_passing``
(or ``gdn_relay``) run one after the other in this process: each ``all_gather`` hands out what every
rank put in on the previous pass (``ReplayGroup``), and the passes repeat until no payload changes,
which makes the result exactly what two GPUs compute (the kernels are deterministic with
``race_free_gdn_kkt``). Prints, per case, the relative RMS and max error against the fp32 scan
(``*_vs_one_gpu``: against the one-GPU kernels) of the outputs (all tokens, and the tokens whose
output gets the state-passing correction) and of the final states. The relay should equal the
one-GPU kernels bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import torch

from .layer_cases_gpu import errors

CASES = {  # (num_computed, num_new) per request
    "fresh_16k": ([0], [16384]),
    "continuation_8k_after_8k": ([8192], [8192]),
    "batch": ([0, 0, 1500, 40], [8192, 1, 3000, 7]),
}


class ReplayGroup:
    """GroupCoordinator's ``all_gather`` for ranks run one after the other in one process."""

    def __init__(self, world_size: int, rank: int, book: dict):
        self.world_size, self.rank_in_group, self.book, self.calls = world_size, rank, book, 0

    def all_gather(self, x, dim=0):
        parts = self.book.setdefault(self.calls, [None] * self.world_size)
        self.calls += 1
        parts[self.rank_in_group] = x.clone()
        return torch.cat([p if p is not None and p.shape == x.shape else torch.zeros_like(x) for p in parts])


def _inputs(num_computed, num_new, dev):
    from qwen36_pcp.tools.layer_inputs import gdn_inputs

    inp, w = gdn_inputs(num_computed, num_new, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    hv = w.A_log.shape[0]
    lo, hi = math.log(1e-3), math.log(1e-1)  # make_checkpoint's dt law: per-step decay ~0.2 .. ~0.999
    dt = torch.exp(torch.rand(hv, device=dev, generator=g) * (hi - lo) + lo)
    w.dt_bias = dt + torch.log(-torch.expm1(-dt))
    inp["a"] = (inp["a"].float() * 0.1).to(inp["a"].dtype)
    return inp, w


def run_case(num_computed, num_new, dev, world_size=2, kernels=None):
    """``kernels``: the bf16 kernels under test (vLLM's by default; the torch ones check this probe on CPU)."""
    from qwen36_pcp.layers.gdn_cp import (
        TorchGDNKernels,
        VllmGDNKernels,
        gdn_full_reference,
        gdn_relay,
        gdn_state_passing,
    )
    from qwen36_pcp.plan import PCPConfig, PCPPlan

    kernels = kernels or VllmGDNKernels
    inp, w = _inputs(num_computed, num_new, dev)
    T = sum(num_new)
    hv, dv = w.A_log.shape[0], w.head_v_dim
    cu_cpu = torch.tensor([0] + list(torch.tensor(num_new).cumsum(0)), dtype=torch.int32)

    def full(kernels, dtype):
        out = torch.zeros(T, hv, dv, device=dev, dtype=dtype)
        conv, ssm = inp["conv_state"].clone().to(dtype), inp["ssm_state"].clone()
        w_ = w if dtype == torch.bfloat16 else dataclasses.replace(w, conv_weight=w.conv_weight.float())
        gdn_full_reference(kernels, inp["mixed_qkv"].to(dtype), inp["b"].to(dtype), inp["a"].to(dtype), out,
                           w_, conv, ssm, inp["state_idx"], num_computed, cu_cpu)
        return out, ssm

    truth, truth_ssm = full(TorchGDNKernels, torch.float32)
    one_gpu, one_gpu_ssm = full(kernels, torch.bfloat16)

    plans = [PCPPlan(num_computed, num_new, world_size, r, PCPConfig(min_split_tokens=64))
             for r in range(world_size)]
    pcp, pcp_ssm = {}, {}
    for mode, core in (("state_passing", gdn_state_passing), ("relay", gdn_relay)):
        pcp[mode], pcp_ssm[mode] = replay_ranks(plans, core, kernels, inp, w, one_gpu, dev)
    # rows of blocks that start after block 0 of a split request: their output gets X_in c_t
    corr = []
    for plan in plans:
        t = plan.device_tensors(dev)
        cu = t.cu_q_cpu.tolist()
        corr += [t.local_idx[cu[j] : cu[j + 1]] for blk, slots in plan.split_block_slots().items()
                 if blk > 0 for j in slots]
    corr = torch.cat(corr) if corr else torch.zeros(0, dtype=torch.long, device=dev)
    lines = inp["state_idx"]
    res = {}
    for name, out, ssm in (("one_gpu", one_gpu, one_gpu_ssm),
                           *((f"pcp2_{m}", pcp[m], pcp_ssm[m]) for m in pcp)):
        res[name] = {"output": errors(out, truth), "corrected_rows": errors(out[corr], truth[corr]),
                     "final_state": errors(ssm[lines], truth_ssm[lines])}
    for m in pcp:
        res[f"pcp2_{m}_vs_one_gpu"] = {"output": errors(pcp[m], one_gpu),
                                       "corrected_rows": errors(pcp[m][corr], one_gpu[corr]),
                                       "final_state": errors(pcp_ssm[m][lines], one_gpu_ssm[lines])}
    res["num_corrected_rows"] = int(corr.numel())
    return res


def replay_ranks(plans, core, kernels, inp, w, like, dev):
    """Every rank of ``core`` in this process, replayed until no all_gather payload changes; returns
    the outputs in the full layout and the last rank's ssm cache."""
    from qwen36_pcp.layers.context import PCPContext

    world_size = len(plans)
    hv, dv = like.shape[1], like.shape[2]
    book, outs, ssms = {}, {}, {}
    for _ in range(2 * plans[0].num_blocks):  # a relay hands a state on once per run of blocks
        before = {k: [None if p is None else p.clone() for p in v] for k, v in book.items()}
        for r, plan in enumerate(plans):
            ctx = PCPContext(plan, ReplayGroup(world_size, r, book), dev)
            idx = ctx.t.local_idx
            out = torch.zeros(plan.t_pad, hv, dv, device=dev, dtype=torch.bfloat16)
            conv, ssm = inp["conv_state"].clone(), inp["ssm_state"].clone()
            core(ctx, kernels, *(inp[k][idx] for k in ("mixed_qkv", "b", "a")), out, w, conv, ssm,
                 inp["state_idx"])
            outs[r], ssms[r] = (idx[:plan.num_local_tokens], out[:plan.num_local_tokens]), ssm
        same = before.keys() == book.keys() and all(
            a is not None and torch.equal(a, b) for k in book for a, b in zip(before[k], book[k]))
        if same:
            break
    else:
        raise RuntimeError("replayed all_gather payloads did not settle")
    full = torch.zeros_like(like)
    for i, o in outs.values():
        full[i] = o
    return full, ssms[world_size - 1]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/qwen36_pcp_gpu_results"))
    args = ap.parse_args(argv)
    from qwen36_pcp.runner_hooks import race_free_gdn_kkt

    race_free_gdn_kkt()
    torch.manual_seed(0)
    results = {}
    print(f"{'case':26} {'what':30} {'rows':14} {'rel RMS':>10} {'max abs':>10}")
    for case, (computed, new) in CASES.items():
        res = results[case] = run_case(computed, new, torch.device("cuda"))
        for what in ("one_gpu", "pcp2_state_passing", "pcp2_state_passing_vs_one_gpu", "pcp2_relay",
                     "pcp2_relay_vs_one_gpu"):
            for rows in ("output", "corrected_rows", "final_state"):
                if rows in res[what]:
                    e = res[what][rows]
                    print(f"{case:26} {what:30} {rows:14} {e['rel_rms']:10.3e} {e['max_abs']:10.3e}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_gdn_precision.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
